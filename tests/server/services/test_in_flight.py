"""The in-flight section's arithmetic: expected finish from the host's pace, else the job's, never past
the deadline; stragglers against the median of the job's finished assignments."""

from datetime import datetime, timedelta

import pytest

from crowdtrain.server.services.in_flight import expected_finish, is_straggler, median_duration

SENT = datetime(2024, 1, 1, 12, 0, 0)
DEADLINE = SENT + timedelta(seconds=60)


@pytest.mark.parametrize(
    ("host", "job", "finish", "source"),
    [
        (10.0, 30.0, SENT + timedelta(seconds=10), "host"),
        (None, 30.0, SENT + timedelta(seconds=30), "job"),
        (None, None, DEADLINE, "deadline"),
        (600.0, None, DEADLINE, "host"),  # a slow host's pace runs past the deadline: it times out there
    ],
)
def test_expected_finish(host, job, finish, source) -> None:
    assert expected_finish(SENT, DEADLINE, host, job) == (finish, source)


def test_a_straggler_runs_longer_than_twice_the_median_and_none_before_one_finished() -> None:
    typical = median_duration([10.0, 20.0, 90.0])
    assert typical == 20.0
    assert is_straggler(41.0, typical) and not is_straggler(40.0, typical)
    assert median_duration([]) is None and not is_straggler(1e9, None)
