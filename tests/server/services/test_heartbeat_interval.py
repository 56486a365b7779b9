"""The heartbeat interval a work reply names (crowdtrain.server.services.results.heartbeat_interval):
the scheduler's, or a third of the shortest lease it gives when that is sooner."""

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas import MIN_HEARTBEAT_S, AssignmentOut
from crowdtrain.server.services.results import heartbeat_interval
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, private_scheduler

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _leased(seconds: float) -> AssignmentOut:
    return AssignmentOut.model_construct(deadline=NOW + timedelta(seconds=seconds))


def test_the_interval_is_the_schedulers_unless_a_lease_given_is_shorter_than_three_of_them() -> None:
    assert heartbeat_interval(30.0, [], NOW) == 30.0  # nothing given
    assert heartbeat_interval(30.0, [_leased(120), _leased(600)], NOW) == 30.0
    assert heartbeat_interval(30.0, [_leased(600), _leased(45)], NOW) == 15.0
    assert heartbeat_interval(30.0, [_leased(0.5)], NOW) == MIN_HEARTBEAT_S
    assert heartbeat_interval(0.4, [_leased(0.5)], NOW) == 0.4  # the operator's own, shorter


def test_a_work_reply_of_a_job_with_a_short_deadline_names_a_third_of_it(tmp_path: Path) -> None:
    with private_scheduler(tmp_path) as sched:
        spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
        spec["scheduling"]["deadline_seconds"] = 6
        ok(sched.admin().post("/v1/jobs", json=spec))
        host = sched.register("alice")
        idle = ok(host.post("/v1/work", json={"free_slots": 0})).json()
        assert idle["assignments"] == [] and idle["heartbeat_interval"] == sched.settings.heartbeat_interval
        reply = json.loads(ok(host.post("/v1/work", json={"free_slots": 1})).content)
        assert len(reply["assignments"]) == 1
        assert 1.5 < reply["heartbeat_interval"] <= 2.0 < sched.settings.heartbeat_interval
