"""The merge pace measured over a job's latest merges (no I/O): merges per second between the oldest
and the newest merge, and the median time from dispatch to upload."""

from datetime import datetime, timedelta

import pytest

from crowdtrain.server.ledger.pace import Pace, pace_of

T0 = datetime(2026, 1, 1)


def at(*seconds: float | None) -> tuple:
    sent, uploaded, finished = (None if s is None else T0 + timedelta(seconds=s) for s in seconds)
    return sent, uploaded, finished


def test_the_rate_spans_the_merges_and_the_turnaround_is_the_median_upload_time() -> None:
    # Merged in any order: 3 intervals over 6 s; dispatch-to-upload 2, 3, 5 and 9 s.
    pace = pace_of([at(0, 5, 12), at(0, 2, 6), at(1, 4, 8), at(0, 9, 10)])
    assert pace == Pace(merge_rate=pytest.approx(0.5), turnaround_seconds=pytest.approx(4.0))


@pytest.mark.parametrize(
    "merges",
    [[], [at(0, 2, 6)], [at(0, 2, 6), at(1, 3, 6)]],
    ids=["none", "one merge", "all at one instant"],
)
def test_no_pace_is_told_without_a_span_of_merges(merges: list) -> None:
    assert pace_of(merges) is None
