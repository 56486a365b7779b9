"""Results that come after their job has succeeded are refused (the job no longer merges), and the
job's problems count them apart: GET /v1/jobs/{id}/problems (`late`, `late_recent`), the dashboard's
job data and `crowdtrain job status` show them separately from the refusals, errors and timeouts."""

import redis
from rich.console import Console

from crowdtrain.assimilator.merge import MergeServices, assimilate
from crowdtrain.cli.progress import problems_view
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas_jobs import JobProblems
from crowdtrain.core.states import JobStatus
from crowdtrain.core.storage import open_storage
from crowdtrain.core.tensors import decode, encode
from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.job_end import cancel_open_workunits, lock_job
from crowdtrain.server.ledger.models import utcnow
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, scheduler_app


def test_a_result_after_the_job_succeeded_is_late_not_a_problem(tmp_path, private_redis: redis.Redis) -> None:
    with scheduler_app(tmp_path / "var", private_redis) as sched:
        admin = sched.admin()
        job_id = ok(admin.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))).json()["job_id"]
        alice = sched.register("alice")
        bad, late = ok(alice.post("/v1/work", json={"free_slots": 2})).json()["assignments"]
        # A real problem, while the job runs: a result that is not safetensors.
        assert alice.put(f"/v1/assignments/{bad['assignment_id']}/result", content=b"junk").status_code == 422
        # The job succeeds (its open workunits cancelled, as the stop rule's end does) ...
        with sched.db.begin() as s:
            job = lock_job(s, job_id)
            cancel_open_workunits(s, job_id)
            states.move(job, JobStatus.succeeded)
            job.finished_at = utcnow()
        # ... and alice's other result comes after it: refused by its merge, uncharged.
        snapshot = decode(alice.get(late["snapshot"]["url"]).content)
        result = {k: (v + 1e-3).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in snapshot.items()}
        ok(alice.put(f"/v1/assignments/{late['assignment_id']}/result", content=encode(result)))
        services = MergeServices(sched.db, open_storage(sched.settings.resolved_storage_url), private_redis, 3)
        assimilate(services, late["assignment_id"])

        problems = JobProblems.model_validate(ok(admin.get(f"/v1/jobs/{job_id}/problems")).json())
        assert problems.counts == {"rejected": 1}
        assert [p.assignment_id for p in problems.recent] == [bad["assignment_id"]]
        assert problems.late == 1
        assert [(p.assignment_id, p.status, p.message) for p in problems.late_recent] == [
            (late["assignment_id"], "rejected", "job is no longer running")
        ]
        assert not any("no longer running" in r.reason for r in problems.reasons)

        console = Console(width=200, record=True)
        console.print(problems_view(problems))
        shown = console.export_text()
        assert "1 results came after the job had ended, too late to merge (not counted as problems)" in shown
        assert shown.count("no longer running") == 0


def test_before_the_job_ends_nothing_is_late(tmp_path, private_redis: redis.Redis) -> None:
    with scheduler_app(tmp_path / "var", private_redis) as sched:
        admin = sched.admin()
        job_id = ok(admin.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))).json()["job_id"]
        alice = sched.register("alice")
        (a,) = ok(alice.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
        assert alice.put(f"/v1/assignments/{a['assignment_id']}/result", content=b"junk").status_code == 422
        problems = ok(admin.get(f"/v1/jobs/{job_id}/problems")).json()
        assert problems["counts"] == {"rejected": 1} and problems["late"] == 0 and problems["late_recent"] == []
