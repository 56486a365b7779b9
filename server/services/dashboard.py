"""The figures of the web dashboard: the operator's job and hosts pages, and the public project page.

Read-only: everything here is gathered from the database (and the job services' own figures) in one
transaction per page; nothing is written. The public figures carry account names, counts and credit only,
never a token, a hash, an address or a data location.
"""

from collections import defaultdict
from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.schemas import HostPublic
from crowdtrain.core.schemas_dashboard import (
    HostCredit,
    HostFigures,
    JobDashboard,
    ProjectJob,
    ProjectPublic,
    Staleness,
    Volunteer,
)
from crowdtrain.core.schemas_jobs import best_closed_epoch
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.server.ledger.models import Assignment, Host, Job, Workunit, utcnow
from crowdtrain.server.services import diagnosis, jobs
from crowdtrain.server.services.telemetry import ACTIVE_WINDOW

MERGE_RATE_WINDOW = timedelta(seconds=60)
RECENT_MERGES = 20
PROBLEMS_SHOWN = 10
_MERGED = AssignmentStatus.merged.value
ANONYMOUS = "anonymous"  # the volunteer that hosts registered without an account add up under


def staleness(taus: list[int]) -> Staleness:
    """Mean, maximum and recent mean of staleness values given oldest merge first. No I/O."""
    recent = taus[-RECENT_MERGES:]
    return Staleness(
        merges=len(taus),
        mean=sum(taus) / len(taus) if taus else None,
        max=max(taus, default=None),
        recent_mean=sum(recent) / len(recent) if recent else None,
    )


def job_dashboard(db: sessionmaker[Session], job_id: int) -> JobDashboard:
    """The job page's figures (JobNotFound if there is no such job)."""
    status = jobs.job_status(db, job_id, with_metrics=True)
    problems = diagnosis.job_problems(db, job_id, PROBLEMS_SHOWN)
    with db.begin() as s:
        mode = s.scalars(select(Job.mode).where(Job.id == job_id)).one()
        by_status = s.execute(
            select(Workunit.epoch, Workunit.status, func.count())
            .where(Workunit.job_id == job_id)
            .group_by(Workunit.epoch, Workunit.status)
        ).all()
        merged = s.execute(
            select(Assignment.base_version, Assignment.merged_version, Assignment.finished_at)
            .where(Assignment.job_id == job_id, Assignment.status == _MERGED, Assignment.merged_version.is_not(None))
            .order_by(Assignment.merged_version)
        ).all()
        now = utcnow()
    workunits: dict[WorkunitStatus, int] = defaultdict(int)
    epoch_workunits: dict[WorkunitStatus, int] = {}
    for epoch, wu_status, n in by_status:
        workunits[WorkunitStatus(wu_status)] += n
        if epoch == status.current_epoch:
            epoch_workunits[WorkunitStatus(wu_status)] = n
    # τ = W_s's version when the result was merged (one before the version the merge made) − its base version.
    taus = [version - 1 - base for base, version, _ in merged if version is not None]
    recent = sum(1 for *_, at in merged if at is not None and at > now - MERGE_RATE_WINDOW)
    elapsed = status.elapsed_seconds
    # A job younger than the window has merged over its age, not over the whole window.
    window = min(MERGE_RATE_WINDOW.total_seconds(), elapsed or MERGE_RATE_WINDOW.total_seconds())
    return JobDashboard(
        job=status,
        mode=mode,
        workunits=dict(workunits),
        epoch_workunits=epoch_workunits,
        merges_per_second=recent / max(window, 1.0),
        merges_per_second_overall=len(merged) / elapsed if elapsed else None,
        staleness=staleness(taus),
        problems=problems,
    )


def host_figures(db: sessionmaker[Session]) -> list[HostFigures]:
    """Every host with its frameworks, merged results, examples and training throughput, oldest first."""
    with db.begin() as s:
        done = {
            host_id: (n, examples or 0, seconds)
            for host_id, n, examples, seconds in s.execute(
                select(
                    Assignment.host_id,
                    func.count(),
                    func.coalesce(func.sum(Assignment.examples), 0),
                    func.sum(Assignment.train_seconds),
                )
                .where(Assignment.status == _MERGED)
                .group_by(Assignment.host_id)
            )
        }
        figures = []
        for host in s.scalars(select(Host).order_by(Host.id)):
            n, examples, seconds = done.get(host.id, (0, 0, None))
            figures.append(
                HostFigures(
                    **HostPublic.model_validate(host, from_attributes=True).model_dump(),
                    frameworks=[f for f in host.frameworks.split(",") if f],
                    results_merged=n,
                    examples=examples,
                    examples_per_second=examples / seconds if seconds else None,
                )
            )
        return figures


def best_accuracy(s: Session, job_id: int) -> float | None:
    """The job's best of closed epochs (crowdtrain.core.schemas_jobs.best_closed_epoch)."""
    best = best_closed_epoch(jobs.epoch_figures(s, job_id))
    return None if best is None else best.mean_accuracy


def project_public(db: sessionmaker[Session]) -> ProjectPublic:
    """The public project page: every job that is not pending, every volunteer account's contribution and
    every host's credit by number. Account names, statuses, counts and credit only: not a host's name,
    which is often its machine's."""
    with db.begin() as s:
        per_job = {
            job_id: (n, examples or 0)
            for job_id, n, examples in s.execute(
                select(Assignment.job_id, func.count(), func.coalesce(func.sum(Assignment.examples), 0))
                .where(Assignment.status == _MERGED)
                .group_by(Assignment.job_id)
            )
        }
        project_jobs = [
            ProjectJob(
                name=j.name,
                status=JobStatus(j.status),
                current_epoch=j.current_epoch,
                max_epochs=j.spec["stop"].get("max_epochs"),
                best_accuracy=best_accuracy(s, j.id),
                results_merged=per_job.get(j.id, (0, 0))[0],
                examples=per_job.get(j.id, (0, 0))[1],
            )
            for j in s.scalars(select(Job).where(Job.status != JobStatus.pending.value).order_by(Job.id))
        ]
        per_host = {
            host_id: (n, examples or 0)
            for host_id, n, examples in s.execute(
                select(Assignment.host_id, func.count(), func.coalesce(func.sum(Assignment.examples), 0))
                .where(Assignment.status == _MERGED)
                .group_by(Assignment.host_id)
            )
        }
        volunteers: dict[str, Volunteer] = {}
        host_credit = []
        for host in s.scalars(select(Host).order_by(Host.id)):
            account = host.account or ANONYMOUS
            v = volunteers.setdefault(
                account, Volunteer(name=account, hosts=0, results_merged=0, results_valid=0, examples=0, credit=0.0)
            )
            n, examples = per_host.get(host.id, (0, 0))
            v.hosts += 1
            v.results_merged += n
            v.results_valid += host.results_valid
            v.examples += examples
            v.credit += host.credit
            host_credit.append(HostCredit(host_id=host.id, account=host.account, credit=host.credit, results=n))
        active = s.scalar(select(func.count()).select_from(Host).where(Host.last_seen > utcnow() - ACTIVE_WINDOW))
    ranked = sorted(volunteers.values(), key=lambda v: (-v.credit, -v.examples, v.name))
    return ProjectPublic(
        jobs=project_jobs,
        volunteers=ranked,
        hosts=sorted(host_credit, key=lambda h: (-h.credit, h.host_id)),
        hosts_active=active or 0,
        results_merged=sum(j.results_merged for j in project_jobs),
        examples=sum(j.examples for j in project_jobs),
        credit=sum(v.credit for v in ranked),
    )
