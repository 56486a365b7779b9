"""The reasons and findings of a job's problems, without a server."""

from collections import Counter

import pytest

from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.models import Job
from crowdtrain.server.services.diagnosis import findings, problem_reason


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("no result by the deadline 2026-11-23 22:10:05.123456", "no result by the deadline # #"),
        (
            "stale result: based on v3, W_s is v17 (max_staleness 8)",
            "stale result: based on #, W_s is # (max_staleness #)",
        ),
        (
            "update norm ||W_c - W_base|| = 3.2e+04 exceeds 12.5 (10x median)",
            "update norm ||W_c - W_base|| = # exceeds # (#x median)",
        ),
        ("CUDA out of\n memory", "CUDA out of memory"),
        ("", "(no message)"),
    ],
)
def test_a_reason_is_the_message_without_its_particulars(message: str, reason: str) -> None:
    assert problem_reason(message) == reason


def _job(model: dict, status: str = "running") -> Job:
    return Job(status=status, model_config_=model, spec={"scheduling": {"deadline_seconds": 300}})


def test_a_keras_job_among_pytorch_hosts_is_said_to_need_tensorflow() -> None:
    said = findings(_job({"name": "keras", "framework": "tensorflow"}), 3, 0, 0, Counter())
    assert said == ["no host can run this job: it needs tensorflow, which none of the 3 registered hosts has"]


def test_idle_hosts_refusals_and_timeouts_each_get_a_sentence() -> None:
    counts = Counter({AssignmentStatus.rejected: 4, AssignmentStatus.timed_out: 2})
    said = findings(_job({"name": "cnn1d"}), 2, 2, 0, counts)
    assert said[0].startswith("none of the 2 hosts able to run this job has asked for work")
    assert said[1] == "4 uploads were refused by the parameter servers"
    assert said[2].startswith("2 assignments timed out") and "deadline_seconds=300" in said[2]


def test_a_finished_job_has_no_findings() -> None:
    assert findings(_job({"name": "cnn1d"}, "failed"), 0, 0, 0, Counter({AssignmentStatus.rejected: 1})) == []
