"""Assignments once opened: what hosts report (heartbeats, abandonments, errors, refused uploads;
a result's upload itself is crowdtrain.server.ledger.uploads), time-outs and revocations; claiming
workunits and opening their assignments is crowdtrain.server.ledger.claims. Ending an assignment
returns its workunit to the pool, or fails it after `max_errors`; the epochs whose workunits failed
are then closed by crowdtrain.server.ledger.epochs.close_epochs_after_failure."""

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.jobspec import SchedulingSpec, scheduling_of
from crowdtrain.core.logs import ids
from crowdtrain.core.refusals import NotFound, Refusal, RefusalKind
from crowdtrain.core.schemas import HostPublic
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger import reputation, states
from crowdtrain.server.ledger.epochs import close_epochs_after_failure
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.ledger.models import Assignment, Host, Job, Workunit, utcnow

log = logging.getLogger(__name__)


class ResultProblem(Refusal):
    """A request about an assignment that cannot be honoured, and why (`kind`)."""

    def __init__(self, kind: RefusalKind, message: str):
        super().__init__(message, kind)


# Row locks are always taken in one order, assignment -> host -> workunit -> job, so that
# concurrent transitions on PostgreSQL cannot deadlock.


def own_assignment(s: Session, assignment_id: int, host_id: int) -> Assignment:
    a = s.get(Assignment, assignment_id, with_for_update=True)
    # Someone else's assignment is reported exactly like a missing one: ids are not secrets to probe.
    if a is None or a.host_id != host_id:
        raise ResultProblem(RefusalKind.not_found, f"assignment {assignment_id} does not exist or is not yours")
    return a


class ResultRefused(ResultProblem):
    """The upload's content is not an acceptable result: the assignment ends `rejected`."""

    def __init__(self, message: str, kind: RefusalKind = RefusalKind.unacceptable):
        super().__init__(kind, message)


def refuse_result(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    host_id: int,
    assignment_id: int,
    reason: str,
    evaluator: Evaluator,
) -> None:
    """End the assignment `rejected` (charged to the host) for an unacceptable upload; its workunit is
    ready again at once, or failed after `max_errors`, and then its epoch is closed if complete
    (`evaluator` scores the final model if that ends the job). Nothing happens if the assignment is
    no longer in progress."""
    with db.begin() as s:
        a = own_assignment(s, assignment_id, host_id)
        if a.status != AssignmentStatus.in_progress.value:
            return
        failed = _failed(end_assignment(s, a, AssignmentStatus.rejected, f"upload refused: {reason}"))
    close_epochs_after_failure(db, storage, r, failed, evaluator)


def _failed(wu: Workunit) -> list[tuple[int, int]]:
    """[(job id, epoch)] of `wu` if it failed for good, else []."""
    return [(wu.job_id, wu.epoch)] if wu.status == WorkunitStatus.failed.value else []


def heartbeat(db: sessionmaker[Session], host_id: int, assignment_id: int) -> tuple[bool, str, datetime | None]:
    """Record that the host is still working and extend its lease; returns (whether the work is
    still wanted, why not, the assignment's deadline now).

    A live assignment's deadline moves to now + `deadline_seconds`, never back and never past
    sent_at + `lease_max_factor` x `deadline_seconds`: a slow host that keeps heartbeating keeps its
    work, a silent one is timed out at its last deadline, and a hung one at the bound.
    """
    with db.begin() as s:
        return heartbeat_in(s, host_id, assignment_id)


def heartbeat_in(s: Session, host_id: int, assignment_id: int) -> tuple[bool, str, datetime | None]:
    """`heartbeat` inside the caller's transaction `s` (one that authenticated the host, say)."""
    a = own_assignment(s, assignment_id, host_id)
    now = utcnow()
    s.get_one(Host, host_id).last_seen = now
    if a.status != AssignmentStatus.in_progress.value:
        return False, f"assignment is {a.status}", None
    job = s.get_one(Job, a.job_id)
    if job.status != JobStatus.running.value:
        return False, f"job is {job.status}", None
    a.last_heartbeat = now
    a.deadline = max(a.deadline, extended_deadline(a.sent_at, now, scheduling_of(job.spec)))
    return True, "", a.deadline


@dataclass(frozen=True)
class SnapshotFile:
    """A published snapshot's object: its storage key, digest and size in bytes."""

    key: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Binding:
    """The snapshot an assignment trains from: W_s `version` of job `job_id`, with the job's newest
    snapshot's file when that is the one (None: the assignment keeps the snapshot it was dispatched with)."""

    job_id: int
    version: int
    file: SnapshotFile | None


def bind_snapshot(db: sessionmaker[Session], host_id: int, assignment_id: int) -> Binding:
    """The snapshot the host's assignment trains from, asked when a compute slot starts it. With the job's
    scheduling.snapshot_binding "start" the assignment moves to the newest published snapshot (its
    base_version, against which its upload is decoded and its staleness counted); a replicated workunit's
    replicas keep the snapshot they were dispatched with, so their results stay comparable. Asked again
    (an answer lost on the way), it moves on to the newest again: the base the host trains from is the
    last one answered. ResultProblem not_found / conflict as for heartbeats, and once the result is in."""
    with db.begin() as s:
        a = own_assignment(s, assignment_id, host_id)
        if a.status != AssignmentStatus.in_progress.value or a.upload_key is not None:
            raise ResultProblem(RefusalKind.conflict, f"assignment {assignment_id} is {a.status}, not training")
        job = s.get_one(Job, a.job_id)
        if job.status != JobStatus.running.value or job.snapshot_version is None:
            raise ResultProblem(RefusalKind.conflict, f"job {a.job_id} is {job.status}")
        late = scheduling_of(job.spec).snapshot_binding == "start"
        if late and job.snapshot_version > a.base_version and s.get_one(Workunit, a.workunit_id).quorum <= 1:
            log.info(
                "assignment %s: bound to snapshot v%d when its slot started (dispatched with v%d)",
                a.id,
                job.snapshot_version,
                a.base_version,
                extra=ids(job_id=job.id, assignment_id=a.id, host_id=host_id),
            )
            a.base_version = job.snapshot_version
        if a.base_version != job.snapshot_version or job.snapshot_key is None or job.snapshot_sha256 is None:
            return Binding(job.id, a.base_version, None)
        return Binding(job.id, a.base_version, SnapshotFile(job.snapshot_key, job.snapshot_sha256, job.param_bytes))


def extended_deadline(sent_at: datetime, now: datetime, sched: SchedulingSpec) -> datetime:
    """The deadline a heartbeat at `now` gives an assignment sent at `sent_at` (see `heartbeat`). No I/O."""
    lease = timedelta(seconds=sched.deadline_seconds)
    return min(now + lease, sent_at + sched.lease_max_factor * lease)


def give_up(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    host_id: int,
    assignment_id: int,
    outcome: AssignmentStatus,
    message: str,
    evaluator: Evaluator,
) -> None:
    """The host abandons an assignment or reports that it failed (ResultProblem not_found/conflict when it is
    not the host's or no longer in progress); the workunit goes back to ready, or fails after
    `max_errors`, and then its epoch is closed if complete (`evaluator` as in `refuse_result`)."""
    with db.begin() as s:
        a = own_assignment(s, assignment_id, host_id)
        if a.status != AssignmentStatus.in_progress.value:
            raise ResultProblem(RefusalKind.conflict, f"assignment {assignment_id} is {a.status}, not in progress")
        failed = _failed(end_assignment(s, a, outcome, message))
    close_epochs_after_failure(db, storage, r, failed, evaluator)


def time_out_expired(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    evaluator: Evaluator,
    limit: int = 500,
    now: datetime | None = None,
) -> int:
    """End `timed_out` up to `limit` in-progress assignments past their deadline at `now` (naive UTC,
    default the clock's; rows other transactions hold are skipped); their workunits retry or fail, and
    the epochs of those that failed are closed if complete. Returns how many timed out."""
    failed: list[tuple[int, int]] = []
    with db.begin() as s:
        expired = s.scalars(
            select(Assignment)
            .where(Assignment.status == AssignmentStatus.in_progress.value, Assignment.deadline < (now or utcnow()))
            .order_by(Assignment.deadline)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()
        for a in expired:
            wu = end_assignment(s, a, AssignmentStatus.timed_out, f"no result by the deadline {a.deadline}")
            log.warning(
                "assignment %s (host %s): timed out; workunit %s is now %s",
                a.id,
                a.host_id,
                wu.id,
                wu.status,
                extra=ids(job_id=wu.job_id, epoch=wu.epoch, workunit_id=wu.id, assignment_id=a.id, host_id=a.host_id),
            )
            failed += _failed(wu)
    close_epochs_after_failure(db, storage, r, failed, evaluator)
    return len(expired)


def revoke_host(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, host_id: int, evaluator: Evaluator
) -> HostPublic:
    """Refuse the host from now on and give its running assignments back to the pool at once (ended
    `abandoned`); the epochs of workunits that failed for good are then closed if complete.
    NotFound if there is no such host."""
    with db.begin() as s:
        # Lock order assignment -> host (see above).
        running = s.scalars(
            select(Assignment)
            .where(Assignment.host_id == host_id, Assignment.status == AssignmentStatus.in_progress.value)
            .with_for_update()
        ).all()
        host = s.get(Host, host_id, with_for_update=True)
        if host is None:
            raise NotFound(f"host {host_id} does not exist")
        host.revoked = True
        failed = []
        for a in running:
            failed += _failed(end_assignment(s, a, AssignmentStatus.abandoned, "host revoked by the operator"))
        s.flush()
        public = HostPublic.model_validate(host, from_attributes=True)
    close_epochs_after_failure(db, storage, r, failed, evaluator)
    return public


def end_assignment(
    s: Session, a: Assignment, outcome: AssignmentStatus, message: str, charge: bool | None = None
) -> Workunit:
    """Close a failed/abandoned/timed-out/rejected assignment and return its workunit to the pool.

    The workunit becomes ready again, or failed after `max_errors` charged failures (`charge`
    defaults to whether the outcome is the host's fault). Returns it so the caller can close the
    epoch when that was its last open workunit.
    """
    charge = outcome.counts_as_error if charge is None else charge
    host = s.get_one(Host, a.host_id, with_for_update=True) if charge else None
    states.move(a, outcome)
    a.finished_at = utcnow()
    a.message = message[:1000]
    wu = s.get_one(Workunit, a.workunit_id, with_for_update=True)
    if wu.status != WorkunitStatus.in_progress.value:
        return wu  # already done by a duplicate, or cancelled with its job: nobody is charged
    if host is not None:
        reputation.count_failure(host, s.get_one(Job, a.job_id), outcome, a.message)
    # A duplicate of this workunit may still be running elsewhere: then it stays in progress.
    others = (
        s.query(Assignment)
        .filter(
            Assignment.workunit_id == wu.id,
            Assignment.id != a.id,
            Assignment.status.in_([AssignmentStatus.in_progress.value, AssignmentStatus.uploaded.value]),
        )
        .count()
    )
    if charge:
        wu.error_count += 1
    if others:
        return wu
    job = s.get_one(Job, a.job_id)
    if wu.error_count >= job.spec["scheduling"]["max_errors"]:
        states.move(wu, WorkunitStatus.failed)
        wu.finished_at = utcnow()
        log.warning(
            "workunit %s (job %s epoch %d): failed after %d errors; the epoch goes on without it",
            wu.id,
            wu.job_id,
            wu.epoch,
            wu.error_count,
        )
    else:
        states.move(wu, WorkunitStatus.ready)
        log.info(
            "workunit %s: ready again after assignment %s %s (%s)",
            wu.id,
            a.id,
            outcome.value,
            message,
            extra=ids(job_id=wu.job_id, epoch=wu.epoch, workunit_id=wu.id, assignment_id=a.id),
        )
    return wu
