"""The job page's "In flight" section in-process (GET /dashboard/api/jobs/{id}/in-flight): each running
assignment with its host, age, deadline and expected finish, the results uploaded and not yet merged,
the budget, stragglers against the median of the job's merged assignments, and duplicated workunits.
The job's results are merged by the real merge path; only times are moved back to make a straggler."""

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from crowdtrain.assimilator.merge import MergeServices, assimilate
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.storage import open_storage
from crowdtrain.core.tensors import decode, encode
from crowdtrain.server.ledger.models import Assignment, Host
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ADMIN_TOKEN, Scheduler, ok, scheduler_app

HTTPS = "https://testserver"  # the session cookie is Secure
MERGED_SECONDS = 100.0  # the merged result's dispatch -> upload, set below: the median
STRAGGLER_AGE = timedelta(hours=1)


@dataclass
class Job:
    sched: Scheduler
    job_id: int
    merged: int
    uploaded: int
    alice_running: int
    bob_running: int
    duplicate: int


def result_of(snapshot: dict, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encode(
        {
            k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in snapshot.items()
        }
    )


@pytest.fixture
def job(tmp_path, private_redis: redis.Redis) -> Iterator[Job]:
    """One epoch of 4 workunits: alice holds 3 (one merged, one uploaded and waiting, one running), bob 1
    (running for an hour), carol a duplicate of alice's running one (nothing else is left to give)."""
    with scheduler_app(tmp_path / "var", private_redis) as sched:
        spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
        spec["stop"]["max_epochs"] = 1  # no next epoch to release early: idle hosts get duplicates
        spec["scheduling"]["duplicate_after_seconds"] = 0
        job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
        alice, bob, carol = (sched.register(n) for n in ("alice", "bob", "carol"))
        work = ok(alice.post("/v1/work", json={"free_slots": 3})).json()["assignments"]
        (bobs,) = ok(bob.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
        snapshot = decode(alice.get(work[0]["snapshot"]["url"]).content)
        for i, a in enumerate(work[:2]):
            ok(alice.put(f"/v1/assignments/{a['assignment_id']}/result", content=result_of(snapshot, i)))
        services = MergeServices(sched.db, open_storage(sched.settings.resolved_storage_url), private_redis, 3)
        assimilate(services, work[0]["assignment_id"])
        (carols,) = ok(carol.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
        with sched.db.begin() as s:
            merged = s.get_one(Assignment, work[0]["assignment_id"])
            assert merged.status == "merged" and merged.uploaded_at is not None
            merged.sent_at = merged.uploaded_at - timedelta(seconds=MERGED_SECONDS)
            slow = s.get_one(Assignment, bobs["assignment_id"])
            slow.sent_at -= STRAGGLER_AGE
        yield Job(
            sched,
            job_id,
            work[0]["assignment_id"],
            work[1]["assignment_id"],
            work[2]["assignment_id"],
            bobs["assignment_id"],
            carols["assignment_id"],
        )


def logged_in(sched: Scheduler) -> TestClient:
    browser = TestClient(sched.app, base_url=HTTPS, follow_redirects=False)
    assert browser.post("/dashboard/login", data={"token": ADMIN_TOKEN}).status_code == 303
    return browser


def test_the_in_flight_section_lists_running_work_backlog_stragglers_and_duplicates(job: Job) -> None:
    d = ok(logged_in(job.sched).get(f"/dashboard/api/jobs/{job.job_id}/in-flight")).json()
    running = {a["assignment_id"]: a for a in d["running"]}
    assert set(running) == {job.alice_running, job.bob_running, job.duplicate}
    assert d["running_total"] == 3
    assert [a["assignment_id"] for a in d["running"]][0] == job.bob_running, "oldest first"
    assert {a["host_name"] for a in running.values()} == {"alice", "bob", "carol"}
    # Uploaded and not merged: the merge backlog; with the running ones, the job's in-flight count.
    assert d["merge_backlog"] == 1 and d["oldest_upload_seconds"] >= 0
    assert d["in_flight"]["count"] == 4
    # The median of the merged assignment's dispatch -> upload; bob's, an hour old, is the straggler.
    assert d["median_seconds"] == pytest.approx(MERGED_SECONDS)
    assert d["straggler_factor"] == 2 and d["stragglers"] == 1
    assert [a["assignment_id"] for a in running.values() if a["straggler"]] == [job.bob_running]
    assert running[job.bob_running]["age_seconds"] >= STRAGGLER_AGE.total_seconds()
    # Alice's running workunit has carol's duplicate beside it.
    (wu,) = d["duplicates"]
    assert running[job.alice_running]["workunit_id"] == running[job.duplicate]["workunit_id"] == wu
    assert running[job.alice_running]["duplicate"] and running[job.duplicate]["duplicate"]
    assert not running[job.bob_running]["duplicate"]


def test_expected_finish_comes_from_the_hosts_pace_else_the_deadline(job: Job) -> None:
    d = ok(logged_in(job.sched).get(f"/dashboard/api/jobs/{job.job_id}/in-flight")).json()
    running = {a["assignment_id"]: a for a in d["running"]}
    with job.sched.db.begin() as s:
        alice_pace = s.get_one(Host, s.get_one(Assignment, job.alice_running).host_id).mean_turnaround
        sent = s.get_one(Assignment, job.alice_running).sent_at
    assert alice_pace is not None, "alice's merged result measured her turnaround"
    alice = running[job.alice_running]
    assert alice["expected_from"] == "host"
    expected = sent + timedelta(seconds=alice_pace)
    assert abs(_naive(alice["expected_finish"]) - min(expected, _naive(alice["deadline"]))) < timedelta(seconds=1)
    # Bob and carol have no merged result, and the job's pace needs two merges: their deadline.
    for a in (running[job.bob_running], running[job.duplicate]):
        assert a["expected_from"] == "deadline" and a["expected_finish"] == a["deadline"]


def _naive(iso: str) -> datetime:
    return datetime.fromisoformat(iso).replace(tzinfo=None)


def test_the_in_flight_data_needs_a_session_and_an_existing_job(job: Job) -> None:
    anonymous = TestClient(job.sched.app, base_url=HTTPS, follow_redirects=False)
    assert anonymous.get(f"/dashboard/api/jobs/{job.job_id}/in-flight").status_code == 401
    assert job.sched.admin().get(f"/dashboard/api/jobs/{job.job_id}/in-flight").status_code == 401
    assert logged_in(job.sched).get("/dashboard/api/jobs/999/in-flight").status_code == 404
