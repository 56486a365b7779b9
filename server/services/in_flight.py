"""What a job is waiting on, for the operator's job page: its running assignments (host, age, deadline
and expected finish), its results uploaded and not yet merged against its in-flight budget, its
stragglers and its duplicated workunits.

Read-only: one transaction, nothing written. The arithmetic (`expected_finish`, `median_duration`,
`is_straggler`) is pure and takes `now` as an argument.
"""

from collections import Counter
from datetime import datetime, timedelta
from statistics import median

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.jobspec import DEDLOC
from crowdtrain.core.schemas_dashboard import ExpectedFrom, JobInFlight, RunningAssignment
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.models import Assignment, Host, Job, Workunit, utcnow
from crowdtrain.server.services.jobs import JobNotFound, in_flight_figures

STRAGGLER_FACTOR = 2.0
RUNNING_SHOWN = 200  # the oldest; the counts cover every running assignment
DURATIONS_MEASURED = 200  # latest finished assignments whose median sets the straggler bound
_RUNNING = AssignmentStatus.in_progress.value
_UPLOADED = AssignmentStatus.uploaded.value
# Finished: merged, or a replica validated against the merged one (checked and in flight as one).
_FINISHED = (AssignmentStatus.merged.value, AssignmentStatus.validated.value)


def expected_finish(
    sent_at: datetime, deadline: datetime, host_turnaround: float | None, job_turnaround: float | None
) -> tuple[datetime, ExpectedFrom]:
    """When a running assignment should be back, and from what: sent_at + its host's measured
    turnaround, else the job's; never past the deadline, where the transitioner times it out. The
    deadline itself when neither is measured. No I/O."""
    if host_turnaround is not None:
        return min(sent_at + timedelta(seconds=host_turnaround), deadline), "host"
    if job_turnaround is not None:
        return min(sent_at + timedelta(seconds=job_turnaround), deadline), "job"
    return deadline, "deadline"


def median_duration(durations: list[float]) -> float | None:
    """The median of finished assignments' seconds from dispatch to upload; None with none. No I/O."""
    return median(durations) if durations else None


def is_straggler(age_seconds: float, median_seconds: float | None, factor: float = STRAGGLER_FACTOR) -> bool:
    """Running longer than `factor` x the median of the job's finished ones (never before one has finished)."""
    return median_seconds is not None and age_seconds > factor * median_seconds


def job_in_flight(db: sessionmaker[Session], job_id: int, now: datetime | None = None) -> JobInFlight:
    """The job's in-flight section (JobNotFound if there is no such job) at `now` (naive UTC, default now)."""
    now = utcnow() if now is None else now
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"job {job_id} does not exist")
        running = s.execute(
            select(Assignment, Host.name, Host.mean_turnaround, Workunit.epoch)
            .join(Host, Host.id == Assignment.host_id)
            .join(Workunit, Workunit.id == Assignment.workunit_id)
            .where(Assignment.job_id == job_id, Assignment.status == _RUNNING)
            .order_by(Assignment.sent_at, Assignment.id)
        ).all()
        a_counts: dict[str, int] = {
            status: n
            for status, n in s.execute(
                select(Assignment.status, func.count()).where(Assignment.job_id == job_id).group_by(Assignment.status)
            )
        }
        oldest_upload = s.scalar(
            select(func.min(Assignment.uploaded_at)).where(Assignment.job_id == job_id, Assignment.status == _UPLOADED)
        )
        durations = [
            (uploaded - sent).total_seconds()
            for sent, uploaded in s.execute(
                select(Assignment.sent_at, Assignment.uploaded_at)
                .where(
                    Assignment.job_id == job_id,
                    Assignment.status.in_(_FINISHED),
                    Assignment.uploaded_at.is_not(None),
                )
                .order_by(Assignment.finished_at.desc())
                .limit(DURATIONS_MEASURED)
            )
            if uploaded is not None
        ]
        budget = None if job.mode == DEDLOC else in_flight_figures(s, job, a_counts)
        job_turnaround = job.turnaround_seconds
    typical = median_duration(durations)
    per_workunit = Counter(a.workunit_id for a, *_ in running)
    rows = []
    for a, host_name, host_turnaround, epoch in running:
        age = max((now - a.sent_at).total_seconds(), 0.0)
        finish, source = expected_finish(a.sent_at, a.deadline, host_turnaround, job_turnaround)
        rows.append(
            RunningAssignment(
                assignment_id=a.id,
                workunit_id=a.workunit_id,
                epoch=epoch,
                host_id=a.host_id,
                host_name=host_name,
                sent_at=a.sent_at,
                age_seconds=age,
                deadline=a.deadline,
                expected_finish=finish,
                expected_from=source,
                straggler=is_straggler(age, typical),
                duplicate=per_workunit[a.workunit_id] > 1,
            )
        )
    return JobInFlight(
        job_id=job_id,
        running=rows[:RUNNING_SHOWN],
        running_total=len(rows),
        running_shown=RUNNING_SHOWN,
        merge_backlog=a_counts.get(_UPLOADED, 0),
        oldest_upload_seconds=None if oldest_upload is None else max((now - oldest_upload).total_seconds(), 0.0),
        in_flight=budget,
        median_seconds=typical,
        straggler_factor=STRAGGLER_FACTOR,
        stragglers=sum(r.straggler for r in rows),
        duplicates=sorted(wu for wu, n in per_workunit.items() if n > 1),
    )
