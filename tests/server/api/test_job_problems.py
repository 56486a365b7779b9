"""GET /v1/jobs/{id}/problems says why a job is stuck: its assignments that ended in a client error, a
refusal or a timeout, counted by reason and the latest in full, and whether hosts can run it; GET /v1/jobs
lists every job with its mode, accuracy and age."""

from collections.abc import Iterator

import pytest
import redis

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import free_port, start_redis
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import Scheduler, ok, scheduler_app


@pytest.fixture
def scheduler(tmp_path) -> Iterator[Scheduler]:
    port = free_port()
    svc = start_redis(tmp_path / "redis", port)
    try:
        with scheduler_app(tmp_path / "var", redis.Redis(port=port)) as sched:
            yield sched
    finally:
        svc.stop()


def test_client_errors_are_counted_by_reason_and_listed_newest_first(scheduler: Scheduler) -> None:
    admin = scheduler.admin()
    job_id = ok(admin.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))).json()["job_id"]
    alice = scheduler.register("alice")
    first, second = ok(alice.post("/v1/work", json={"free_slots": 2})).json()["assignments"]
    for a, batch in ((first, 12), (second, 40)):
        ok(
            alice.post(
                f"/v1/assignments/{a['assignment_id']}/error", json={"message": f"out of memory at batch {batch}"}
            )
        )

    problems = ok(admin.get(f"/v1/jobs/{job_id}/problems")).json()

    assert problems["status"] == "running"
    assert problems["counts"] == {"client_error": 2}
    assert problems["reasons"] == [{"status": "client_error", "reason": "out of memory at batch #", "count": 2}]
    assert [(p["assignment_id"], p["host_name"], p["message"]) for p in problems["recent"]] == [
        (second["assignment_id"], "alice", "out of memory at batch 40"),
        (first["assignment_id"], "alice", "out of memory at batch 12"),
    ]
    assert (problems["hosts_registered"], problems["hosts_able"], problems["hosts_able_active"]) == (1, 1, 1)
    assert any("2 assignments ended in a client error" in f for f in problems["findings"])
    assert ok(admin.get(f"/v1/jobs/{job_id}/problems", params={"limit": 1})).json()["recent"][0]["message"] == (
        "out of memory at batch 40"
    )


def test_a_job_without_hosts_says_so_and_the_job_list_shows_it(scheduler: Scheduler) -> None:
    admin = scheduler.admin()
    spec = load_job_spec(EXAMPLE_SPEC)
    job_id = ok(admin.post("/v1/jobs", json=spec.model_dump(mode="json"))).json()["job_id"]

    problems = ok(admin.get(f"/v1/jobs/{job_id}/problems")).json()
    assert problems["counts"] == {} and problems["recent"] == [] and problems["hosts_able"] == 0
    assert problems["findings"] == ["no host has registered (or every one is revoked): start a client"]
    [listed] = ok(admin.get("/v1/jobs")).json()
    assert listed["job_id"] == job_id and listed["name"] == spec.name
    assert (listed["mode"], listed["status"], listed["current_epoch"]) == ("vc-asgd", "running", 1)
    assert listed["max_epochs"] == spec.stop.max_epochs and listed["accuracy"] is None
    assert listed["created_at"].endswith("Z") or listed["created_at"].endswith("+00:00")
