"""What hosts report about their assignments: uploads, heartbeats, abandonments and errors."""

import logging
import secrets
import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.logs import ids
from crowdtrain.schemas import ResultMetrics
from crowdtrain.storage import Storage
from crowdtrain.jobspec import UploadSpec
from crowdtrain.tensors import TensorFormatError
from crowdtrain.updates import decode_update, upload_of
from server import states
from server.models import Assignment, Host, Job, Workunit, utcnow
from server.states import AssignmentStatus, JobStatus, WorkunitStatus

log = logging.getLogger(__name__)


class ResultProblem(Exception):
    """A request about an assignment that cannot be honoured; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# Row locks are always taken in one order, assignment -> host -> workunit -> job, so that
# concurrent transitions on PostgreSQL cannot deadlock.


def _own_assignment(s: Session, assignment_id: int, host_id: int) -> Assignment:
    a = s.get(Assignment, assignment_id, with_for_update=True)
    # Someone else's assignment is reported exactly like a missing one: ids are not secrets to probe.
    if a is None or a.host_id != host_id:
        raise ResultProblem(404, f"assignment {assignment_id} does not exist or is not yours")
    return a


class ResultRefused(ResultProblem):
    """The upload's content is not an acceptable result: the assignment ends `rejected`."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(status, message)


def upload_target(db: sessionmaker[Session], host_id: int, assignment_id: int) -> tuple[int, dict, UploadSpec]:
    """(job id, parameter manifest, upload encoding) a result must match, checked before the body is
    read: the assignment exists, is the caller's and is in progress (else ResultProblem 404/409). Read only."""
    with db.begin() as s:
        a = s.get(Assignment, assignment_id)
        if a is None or a.host_id != host_id:
            raise ResultProblem(404, f"assignment {assignment_id} does not exist or is not yours")
        _check_in_progress(a)
        job = s.get_one(Job, a.job_id)
        return a.job_id, job.param_manifest, upload_of(job.spec.get("assimilation", {}))


def _check_in_progress(a: Assignment) -> None:
    if a.status != AssignmentStatus.in_progress.value:
        raise ResultProblem(409, f"assignment {a.id} is {a.status}; a result can be uploaded once, "
                                 "while the assignment is in progress")


def check_result(body: bytes, manifest: dict, upload: UploadSpec | dict | None = None) -> None:
    """Raise ResultRefused unless `body` is a result encoded as `upload` says (default: weights as
    float32) for a model with `manifest`: names, shapes, the encoding's dtypes, scales, finite decoded
    values (crowdtrain.updates.decode_update). The header is bounded before it is parsed. No I/O."""
    try:
        decode_update(body, manifest, upload)
    except (TensorFormatError, ValueError) as exc:
        raise ResultRefused(f"result rejected: {exc}") from exc


def refuse_result(db: sessionmaker[Session], host_id: int, assignment_id: int,
                  reason: str) -> tuple[int, int] | None:
    """End the assignment `rejected` (charged to the host) for an unacceptable upload; its workunit is
    ready again at once, or failed after `max_errors`. Returns (job id, epoch) when it failed, so the
    caller can close the epoch. Nothing happens if the assignment is no longer in progress."""
    with db.begin() as s:
        a = _own_assignment(s, assignment_id, host_id)
        if a.status != AssignmentStatus.in_progress.value:
            return None
        wu = end_assignment(s, a, AssignmentStatus.rejected, f"upload refused: {reason}")
        return (wu.job_id, wu.epoch) if wu.status == WorkunitStatus.failed.value else None


def store_result(db: sessionmaker[Session], storage: Storage, host_id: int, job_id: int, assignment_id: int,
                 body: bytes, metrics: ResultMetrics, enqueue: Callable[[int, float], None]) -> str:
    """Store a checked result once and queue its merge (ResultProblem 404/409 otherwise).

    The body is written to storage under a key of its own before the (short) transaction, so the
    database's write lock is never held over the transfer; a losing concurrent upload deletes its copy.
    """
    received_at = time.time()
    key = f"jobs/{job_id}/uploads/{assignment_id}-{secrets.token_hex(4)}.safetensors"
    storage.put(key, body)
    try:
        with db.begin() as s:
            a = _own_assignment(s, assignment_id, host_id)
            _check_in_progress(a)
            a.upload_key = key
            states.move(a, AssignmentStatus.uploaded)
            a.uploaded_at = utcnow()
            a.train_loss, a.examples, a.train_seconds = metrics.train_loss, metrics.examples, metrics.seconds
            s.get_one(Host, host_id).last_seen = a.uploaded_at
    except BaseException:
        storage.delete(key)
        raise
    log.info("assignment %s: result uploaded (%d bytes, loss %s), merge queued", assignment_id, len(body),
             metrics.train_loss, extra=ids(assignment_id=assignment_id, host_id=host_id))
    # After the commit: the task must find the assignment uploaded. If this enqueue is lost, the
    # transitioner re-queues merges that stay uploaded too long.
    enqueue(assignment_id, received_at)
    return AssignmentStatus.uploaded.value


def heartbeat(db: sessionmaker[Session], host_id: int, assignment_id: int) -> tuple[bool, str]:
    """Record that the host is still working; tells it whether the work is still wanted."""
    with db.begin() as s:
        a = _own_assignment(s, assignment_id, host_id)
        now = utcnow()
        s.get_one(Host, host_id).last_seen = now
        if a.status != AssignmentStatus.in_progress.value:
            return False, f"assignment is {a.status}"
        job = s.get_one(Job, a.job_id)
        if job.status != JobStatus.running.value:
            return False, f"job is {job.status}"
        a.last_heartbeat = now
        return True, ""


def give_up(db: sessionmaker[Session], host_id: int, assignment_id: int, outcome: AssignmentStatus,
            message: str) -> tuple[int, int] | None:
    """The host abandons an assignment or reports that it failed; the workunit goes back to ready.

    Returns (job id, epoch) when the workunit failed for good, so the caller can close the epoch.
    """
    with db.begin() as s:
        a = _own_assignment(s, assignment_id, host_id)
        if a.status != AssignmentStatus.in_progress.value:
            raise ResultProblem(409, f"assignment {assignment_id} is {a.status}, not in progress")
        wu = end_assignment(s, a, outcome, message)
        return (wu.job_id, wu.epoch) if wu.status == WorkunitStatus.failed.value else None


def end_assignment(s: Session, a: Assignment, outcome: AssignmentStatus, message: str,
                   charge: bool | None = None) -> Workunit:
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
        host.results_failed += 1
        host.consecutive_valid = 0
    # A duplicate of this workunit may still be running elsewhere: then it stays in progress.
    others = s.query(Assignment).filter(Assignment.workunit_id == wu.id, Assignment.id != a.id,
                                        Assignment.status.in_([AssignmentStatus.in_progress.value,
                                                               AssignmentStatus.uploaded.value])).count()
    if charge:
        wu.error_count += 1
    if others:
        return wu
    job = s.get_one(Job, a.job_id)
    if wu.error_count >= job.spec["scheduling"]["max_errors"]:
        states.move(wu, WorkunitStatus.failed)
        wu.finished_at = utcnow()
        log.warning("workunit %s (job %s epoch %d): failed after %d errors; the epoch goes on without it",
                    wu.id, wu.job_id, wu.epoch, wu.error_count)
    else:
        states.move(wu, WorkunitStatus.ready)
        log.info("workunit %s: ready again after assignment %s %s (%s)", wu.id, a.id, outcome.value, message,
                 extra=ids(job_id=wu.job_id, epoch=wu.epoch, workunit_id=wu.id, assignment_id=a.id))
    return wu
