"""What a work request given nothing is told to wait (WorkReply.retry_after): the scheduler's
work_retry_after when nothing is ready, and when the job's in-flight budget holds the host back, the
time its merges take to make room for the hosts waiting on it (hosts / merge rate,
crowdtrain.server.services.backpressure.retry_after), so that held hosts do not sleep through it; the
hosts counted are those holding its work or, when more, those held back lately
(crowdtrain.server.services.held_hosts), so that many idle hosts do not poll as often as one."""

from pathlib import Path

import pytest
from sqlalchemy import update

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.server.ledger.models import Job
from crowdtrain.server.services.backpressure import MIN_RETRY_SECONDS, held_seconds, held_wait, retry_after
from crowdtrain.server.services.held_hosts import note_waiting
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, private_scheduler


def test_the_wait_is_hosts_over_merge_rate_within_its_bounds() -> None:
    assert held_seconds(None, 3) is None and held_seconds(0.0, 3) is None
    assert held_seconds(10.0, 2) == pytest.approx(0.2)
    assert retry_after(None, 2.0) == 2.0
    assert retry_after(0.25, 2.0) == 0.25
    assert retry_after(0.001, 2.0) == MIN_RETRY_SECONDS
    assert retry_after(30.0, 2.0) == 2.0


def test_a_host_held_by_the_budget_is_told_to_ask_again_when_merges_make_room(tmp_path: Path) -> None:
    with private_scheduler(tmp_path) as sched:
        spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
        spec["scheduling"]["max_in_flight"] = 1
        job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
        alice, bob = sched.register("alice"), sched.register("bob")
        assert len(ok(alice.post("/v1/work", json={"free_slots": 1})).json()["assignments"]) == 1
        default = sched.settings.work_retry_after

        held = ok(bob.post("/v1/work", json={"free_slots": 1})).json()
        assert held["assignments"] == [] and held["retry_after"] == default, "no pace measured yet"

        with sched.db.begin() as s:  # the pace the ledger records as merges land
            s.execute(update(Job).where(Job.id == job_id).values(merge_rate=10.0, turnaround_seconds=1.0))
        held = ok(bob.post("/v1/work", json={"free_slots": 1})).json()
        # Two hosts wait on the job's merges (alice holding its work, bob asking): 2 / 10 merges/s.
        assert held["assignments"] == [] and held["retry_after"] == pytest.approx(0.2)
        busy = ok(alice.post("/v1/work", json={"free_slots": 1})).json()
        # alice is the one host holding its work (1 / 10), but two hosts were held lately: 2 / 10.
        assert busy["retry_after"] == pytest.approx(0.2)
        for name in ("carol", "dave", "erin"):
            ok(sched.register(name).post("/v1/work", json={"free_slots": 1}))
        # Five hosts wait now: their requests together come as often as merges make room, 5 / 10.
        assert ok(bob.post("/v1/work", json={"free_slots": 1})).json()["retry_after"] == pytest.approx(0.5)


def test_the_hosts_waiting_are_those_held_within_the_window(private_redis) -> None:
    assert note_waiting(private_redis, 1, now=100.0, window=2.0) == 1
    assert note_waiting(private_redis, 2, now=101.0, window=2.0) == 2
    assert note_waiting(private_redis, 1, now=101.5, window=2.0) == 2  # noted again, counted once
    assert note_waiting(private_redis, 3, now=103.2, window=2.0) == 2  # host 2, last held at 101.0, left
    assert note_waiting(private_redis, 3, now=110.0, window=2.0) == 1


def test_a_wait_grows_with_the_hosts_waiting_beyond_those_holding_work() -> None:
    assert held_wait(None, 10.0, 50) is None  # no job with a pace held it
    assert held_wait(0.2, 10.0, 1) == pytest.approx(0.2)  # fewer waiting than holding: the job's own
    assert held_wait(0.2, 10.0, 40) == pytest.approx(4.0)  # retry_after then bounds it
    assert held_wait(0.2, None, 40) == pytest.approx(0.2)
