"""Why a job is stuck or failed, for the operator: its assignments that ended without a merge (client
errors, refused uploads, timeouts) with their messages, counted by reason, and whether any host can run
it. Everything here is already in the database; this only gathers it."""

import re
from collections import Counter

from sqlalchemy import ColumnElement, false, func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import frameworks
from crowdtrain.core.schemas_jobs import AssignmentProblem, JobProblems, ProblemCount
from crowdtrain.core.states import AssignmentStatus, JobStatus
from crowdtrain.server.ledger import reputation
from crowdtrain.server.ledger.models import Assignment, Host, Job, Workunit, utcnow
from crowdtrain.server.services.jobs import ACTIVE_HOST_WINDOW, JobNotFound

PROBLEMS = (AssignmentStatus.client_error, AssignmentStatus.rejected, AssignmentStatus.timed_out)
# A number, possibly signed, decimal or in exponent form, or a version written v12: the particulars
# of one assignment's message (a deadline's time, a norm, a version), left out of its reason.
_PARTICULARS = re.compile(r"v?[-+]?\d+(?:[.:-]\d+)*(?:[eE][-+]?\d+)?")
REASON_LENGTH = 120


def problem_reason(message: str) -> str:
    """What assignments that failed alike have in common: `message` with its numbers, times and versions
    written `#`, its spaces collapsed, cut at REASON_LENGTH characters. No I/O."""
    reason = " ".join(_PARTICULARS.sub("#", message).split())
    return reason[:REASON_LENGTH] or "(no message)"


def job_problems(
    db: sessionmaker[Session], job_id: int, limit: int = 20, peer_refusals: dict[int, dict] | None = None
) -> JobProblems:
    """The job's problems (JobNotFound if there is no such job): every assignment that ended in a client
    error, a refusal or a timeout counted by status and by reason, the `limit` latest in full, and the
    hosts that could run it; apart from them, the results that came too late, once the job had ended
    (`late_result`); for a DeDLOC job, the hosts whose peer refused it (`peer_refusals`, as
    crowdtrain.server.services.dedloc_jobs.refusals gives them)."""
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"job {job_id} does not exist")
        statuses = [p.value for p in PROBLEMS]
        late = late_result(job)
        by_message = s.execute(
            select(Assignment.status, Assignment.message, func.count())
            .where(Assignment.job_id == job_id, Assignment.status.in_(statuses), ~late)
            .group_by(Assignment.status, Assignment.message)
        ).all()
        counts: Counter[AssignmentStatus] = Counter()
        reasons: Counter[tuple[AssignmentStatus, str]] = Counter()
        for status, message, n in by_message:
            counts[AssignmentStatus(status)] += n
            reasons[(AssignmentStatus(status), problem_reason(message))] += n
        recent = _latest(s, job_id, Assignment.status.in_(statuses) & ~late, limit)
        late_count = s.scalar(select(func.count()).select_from(Assignment).where(Assignment.job_id == job_id, late))
        late_recent = _latest(s, job_id, late, limit) if late_count else []
        hosts = s.scalars(select(Host).where(Host.revoked.is_(False))).all()
        able = [h for h in hosts if frameworks.runs_on(job.model_config_, h.frameworks)]
        active = [h for h in able if h.last_seen > utcnow() - ACTIVE_HOST_WINDOW]
        waiting = s.scalar(
            select(func.count())
            .select_from(Assignment)
            .join(Workunit, Workunit.id == Assignment.workunit_id)
            .where(
                Assignment.job_id == job_id,
                Assignment.status == AssignmentStatus.uploaded.value,
                Workunit.quorum > 1,
                Workunit.canonical_assignment_id.is_(None),
            )
        )
        quarantined = sum(1 for h in able if reputation.is_quarantined(h))
        return JobProblems(
            job_id=job.id,
            status=JobStatus(job.status),
            status_message=job.status_message,
            counts=dict(counts),
            reasons=[
                ProblemCount(status=status, reason=reason, count=n)
                for (status, reason), n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
            recent=recent,
            hosts_registered=len(hosts),
            hosts_able=len(able),
            hosts_able_active=len(active),
            findings=findings(job, len(hosts), len(able), len(active), counts)
            + replication_findings(job, waiting or 0, quarantined, len(able))
            + refusal_findings(peer_refusals or {}, limit),
            late=late_count or 0,
            late_recent=late_recent,
        )


def late_result(job: Job) -> ColumnElement[bool]:
    """An assignment of `job` that uploaded its result and was refused once the job had ended (succeeded,
    failed or cancelled) before its merge: not a host's fault nor the job's, so not a problem. Builds
    the condition; runs nothing."""
    if job.finished_at is None:
        return false()
    return (
        (Assignment.status == AssignmentStatus.rejected.value)
        & Assignment.uploaded_at.is_not(None)
        & (Assignment.finished_at >= job.finished_at)
    )


def _latest(s: Session, job_id: int, condition: ColumnElement[bool], limit: int) -> list[AssignmentProblem]:
    """The `limit` latest ended assignments of the job that meet `condition`, newest first."""
    rows = s.execute(
        select(Assignment, Host.name, Workunit.epoch)
        .join(Host, Host.id == Assignment.host_id)
        .join(Workunit, Workunit.id == Assignment.workunit_id)
        .where(Assignment.job_id == job_id, condition)
        .order_by(Assignment.finished_at.desc(), Assignment.id.desc())
        .limit(limit)
    ).all()
    return [
        AssignmentProblem(
            assignment_id=a.id,
            host_id=a.host_id,
            host_name=name,
            epoch=epoch,
            status=AssignmentStatus(a.status),
            message=a.message,
            finished_at=a.finished_at,
        )
        for a, name, epoch in rows
    ]


def findings(job: Job, registered: int, able: int, active: int, counts: Counter[AssignmentStatus]) -> list[str]:
    """Sentences for the operator from the figures of `job_problems`: what keeps the job from going on."""
    out: list[str] = []
    if job.status != JobStatus.running.value:
        return out
    if registered == 0:
        out.append("no host has registered (or every one is revoked): start a client")
    elif able == 0:
        needs = " or ".join(frameworks.able_to_run(job.model_config_))
        out.append(f"no host can run this job: it needs {needs}, which none of the {registered} registered hosts has")
    elif active == 0:
        out.append(
            f"none of the {able} hosts able to run this job has asked for work in the last "
            f"{ACTIVE_HOST_WINDOW.total_seconds():.0f} seconds: start a client"
        )
    errors = counts[AssignmentStatus.client_error]
    if errors:
        out.append(f"{errors} assignments ended in a client error: see the reasons above and the clients' logs")
    if counts[AssignmentStatus.rejected]:
        out.append(f"{counts[AssignmentStatus.rejected]} uploads were refused by the parameter servers")
    if counts[AssignmentStatus.timed_out]:
        out.append(
            f"{counts[AssignmentStatus.timed_out]} assignments timed out: hosts may be too slow for "
            f"scheduling.deadline_seconds={job.spec['scheduling']['deadline_seconds']}"
        )
    return out


def replication_findings(job: Job, waiting: int, quarantined: int, able: int) -> list[str]:
    """Sentences about replicated work and quarantined hosts (crowdtrain.server.ledger.replicas, reputation)."""
    out: list[str] = []
    if job.status != JobStatus.running.value:
        return out
    if waiting:
        out.append(
            f"{waiting} results wait for replicas from other hosts (validation replicates untrusted hosts' work): "
            "a replica goes to a host that has not had the workunit, of another volunteer account"
        )
    if quarantined:
        out.append(
            f"{quarantined} of the {able} hosts able to run this job are quarantined after repeated refused results: "
            "see `crowdtrain admin host list`"
        )
    return out


def refusal_findings(peer_refusals: dict[int, dict], limit: int) -> list[str]:
    """A sentence per host (the `limit` latest) whose DeDLOC peer refused to train the job, with its reason."""
    latest = sorted(peer_refusals.items(), key=lambda kv: -kv[1]["at"])[:limit]
    return [f"host {host}'s peer {r['peer_id']} refused to train this job: {r['message']}" for host, r in latest]
