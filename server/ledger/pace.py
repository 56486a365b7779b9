"""The pace of a job's merges, measured over its latest merged assignments when each merge is recorded
(crowdtrain.server.ledger.merges.record_merge) and kept on the job's row, where every work request
reads it with the job's other live columns: the in-flight budget (crowdtrain.server.services.backpressure)
is derived from it without a query of its own.

- merge rate: merges per second, (n - 1) / (newest merge - oldest merge) over the latest `WINDOW`
  merges (a validated replica counts as one): what the job's parameter servers have absorbed
  lately (their capacity when results queue, the hosts' supply when they keep up);
- turnaround: the median of those assignments' seconds from dispatch (sent_at) to upload
  (uploaded_at): how long a host takes to return one, the merge queue left out.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from statistics import median

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.models import Assignment, Job

WINDOW = 32  # latest merges measured: about a second of a busy job, a few turnarounds of a small one


@dataclass(frozen=True)
class Pace:
    merge_rate: float  # merges per second
    turnaround_seconds: float  # median dispatch -> upload


def pace_of(merges: Sequence[tuple[datetime, datetime | None, datetime]]) -> Pace | None:
    """The pace of `merges`, each (sent_at, uploaded_at, finished_at); None with fewer than two merges
    or all at one instant (no rate to tell). No I/O."""
    finished = [f for _, _, f in merges]
    span = (max(finished) - min(finished)).total_seconds() if len(merges) >= 2 else 0.0
    turnarounds = [(u - s).total_seconds() for s, u, _ in merges if u is not None]
    if span <= 0 or not turnarounds:
        return None
    return Pace(merge_rate=(len(merges) - 1) / span, turnaround_seconds=max(0.0, median(turnarounds)))


# A replica that agreed with the merged one ends `validated`: the parameter servers checked it as they
# do a merge, and it was in flight as one, so it counts as one here.
_FINISHED = (AssignmentStatus.merged.value, AssignmentStatus.validated.value)
_LATEST = (
    select(Assignment.sent_at, Assignment.uploaded_at, Assignment.finished_at)
    .where(
        Assignment.job_id == bindparam("job_id"),
        Assignment.status == bindparam("status"),
        Assignment.finished_at.is_not(None),
    )
    .order_by(Assignment.finished_at.desc())
    .limit(WINDOW)
)


def measure_pace(s: Session, job: Job) -> None:
    """Measure the job's pace over its latest merges (and validated replicas) and keep it on `job`,
    which the caller holds locked; left as it was when there is nothing to measure. One ordered scan
    of the index on (job, status, finished_at) per status, `WINDOW` rows each."""
    rows: list[tuple[datetime, datetime | None, datetime]] = [
        (r.sent_at, r.uploaded_at, r.finished_at)
        for status in _FINISHED
        for r in s.execute(_LATEST, {"job_id": job.id, "status": status})
    ]
    latest = sorted(rows, key=lambda r: r[2], reverse=True)[:WINDOW]
    pace = pace_of(latest)
    if pace is not None:
        job.merge_rate, job.turnaround_seconds = pace.merge_rate, pace.turnaround_seconds
