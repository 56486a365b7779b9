"""A process's counts of a job's work in flight (crowdtrain.server.services.in_flight_counts): counted
again once older than their age or once W_s moved, its own claims added meanwhile, the clock passed in."""

from pathlib import Path

from sqlalchemy import select, update

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.server.ledger.models import Host, Job
from crowdtrain.server.services import dispatch_host
from crowdtrain.server.services.in_flight_counts import InFlightCounts
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, private_scheduler


def test_counts_are_kept_until_they_age_or_w_s_moves_and_own_claims_count_meanwhile(tmp_path: Path) -> None:
    with private_scheduler(tmp_path) as sched:
        job_id = ok(sched.admin().post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))).json()[
            "job_id"
        ]
        ok(sched.register("alice").post("/v1/work", json={"free_slots": 2}))
        sched.register("bob")
        engine = sched.db.kw["bind"]
        with sched.db.begin() as s:
            bob = s.scalar(select(Host.id).where(Host.name == "bob"))

        def figures(counts: InFlightCounts, now: float) -> tuple[int, int]:
            with engine.begin() as c:
                live = dispatch_host.live_jobs(c.execute(dispatch_host.HOST_BY_ID, {"seen_host": bob}).all())
                job = counts.of(c, live, now)[job_id]
            return job.in_flight, job.in_flight_hosts

        counts = InFlightCounts(max_age=1.0)
        assert figures(counts, now=10.0) == (2, 1)  # alice's two
        ok(sched.register("carol").post("/v1/work", json={"free_slots": 1}))  # another process's claim
        assert figures(counts, now=10.5) == (2, 1), "counted again before its age"
        assert figures(counts, now=11.0) == (3, 2)
        with engine.begin() as c:  # this process gives bob, who held none, two more
            live = dispatch_host.live_jobs(c.execute(dispatch_host.HOST_BY_ID, {"seen_host": bob}).all())
            counts.claimed(c, live[job_id], 2)
        assert figures(counts, now=11.2) == (5, 3)
        with sched.db.begin() as s:  # a merge: W_s moved, and what it merged may have made room
            s.execute(update(Job).where(Job.id == job_id).values(param_version=Job.param_version + 1))
        assert figures(counts, now=11.3) == (3, 2), "counted again once W_s moved"


def test_a_request_for_some_jobs_keeps_the_other_jobs_counts(tmp_path: Path) -> None:
    """A host that runs only some of the running jobs (its frameworks, the jobs it refused) asks for
    their counts alone: the others' stay kept for the hosts that run them, until none asks for a minute."""
    with private_scheduler(tmp_path) as sched:
        spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
        first, second = (ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"] for _ in range(2))
        host = sched.register("alice")
        ok(host.post("/v1/work", json={"free_slots": 1}))
        with sched.db.begin() as s:
            alice = s.scalar(select(Host.id).where(Host.name == "alice"))
        engine = sched.db.kw["bind"]
        counts = InFlightCounts(max_age=1.0)
        with engine.begin() as c:
            live = dispatch_host.live_jobs(c.execute(dispatch_host.HOST_BY_ID, {"seen_host": alice}).all())

        def of(jobs: list[int], now: float) -> dict[int, int]:
            with engine.begin() as c:
                return {j: job.in_flight for j, job in counts.of(c, {j: live[j] for j in jobs}, now).items()}

        both = of([first, second], now=10.0)
        assert sum(both.values()) == 1
        ok(host.post("/v1/work", json={"free_slots": 1}))
        assert of([first], now=10.2) == {first: both[first]}
        assert of([second], now=10.4) == {second: both[second]}
        assert sum(of([first, second], now=11.5).values()) == 2
        assert of([first], now=80.0)[first] >= 1  # asked for again
        assert len(counts._counted) == 1, "the job no one asked for in a minute is forgotten"
