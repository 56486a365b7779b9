"""A host's result upload in the ledger: the target a body must match, read before the body is, and the
record of a checked, stored body as its assignment's upload. Checking and storing the body is the
results service's (crowdtrain.server.services.results)."""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import merge_stages
from crowdtrain.core.assimilationspec import UploadSpec
from crowdtrain.core.credit import assigned_examples
from crowdtrain.core.logs import ids
from crowdtrain.core.merge_stages import Stamps
from crowdtrain.core.refusals import RefusalKind
from crowdtrain.core.schemas import ResultMetrics
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.storage import Storage
from crowdtrain.core.updates import upload_of
from crowdtrain.server.ledger import result_records, states
from crowdtrain.server.ledger.assignments import ResultProblem, own_assignment
from crowdtrain.server.ledger.models import Assignment, Host, Job, Shard, Workunit, utcnow

log = logging.getLogger(__name__)


def upload_target(db: sessionmaker[Session], host_id: int, assignment_id: int) -> tuple[int, dict, UploadSpec]:
    """(job id, parameter manifest, upload encoding) a result must match, checked before the body is
    read: the assignment exists, is the caller's and is in progress (else ResultProblem not_found/conflict).
    Read only."""
    with db.begin() as s:
        a = s.get(Assignment, assignment_id)
        if a is None or a.host_id != host_id:
            raise ResultProblem(RefusalKind.not_found, f"assignment {assignment_id} does not exist or is not yours")
        _check_in_progress(a)
        job = s.get_one(Job, a.job_id)
        return a.job_id, job.param_manifest, upload_of(job.spec.get("assimilation", {}))


def _check_in_progress(a: Assignment) -> None:
    if a.status != AssignmentStatus.in_progress.value:
        raise ResultProblem(
            RefusalKind.conflict,
            f"assignment {a.id} is {a.status}; a result can be uploaded once, while the assignment is in progress",
        )


@dataclass(frozen=True)
class StoredUpload:
    host_id: int
    job_id: int
    assignment_id: int
    key: str  # where the body is stored
    size: int


def _asked_examples(s: Session, a: Assignment) -> int:
    """The examples `a` was asked to train (crowdtrain.core.credit.assigned_examples): one statement
    that reads the shard's examples and the job's spec, not the job's whole row (its manifest)."""
    examples, spec = s.execute(
        select(Shard.examples, Job.spec)
        .join(Workunit, Workunit.shard_id == Shard.id)
        .join(Job, Job.id == Workunit.job_id)
        .where(Workunit.id == a.workunit_id)
    ).one()
    return assigned_examples(examples, spec["training"]["local_epochs"], a.local_fraction)


def record_upload(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis | None,
    upload: StoredUpload,
    metrics: ResultMetrics,
    enqueue: Callable[[int, Stamps], None],
    digest: str | None,
    stamps: Stamps | None,
) -> AssignmentStatus:
    """Record `upload`, a checked body already in storage, as its assignment's result and queue its
    merge (`enqueue`, after the commit); the stored body is deleted if the assignment cannot take it
    (ResultProblem not_found/conflict). Given `digest` (the W_c digest the check took) and `r`, it is
    recorded under the upload's key before the commit (result_records.note_checked_upload), so the
    parameter server neither checks nor hashes the bytes again. `stamps`: the result's merge stages so
    far (crowdtrain.core.merge_stages; default: received now), stamped `recorded` and `queued` here."""
    stamps = merge_stages.received() if stamps is None else stamps
    host_id, assignment_id, key = upload.host_id, upload.assignment_id, upload.key
    try:
        if digest is not None and r is not None:
            result_records.note_checked_upload(r, upload.job_id, key, digest)
        with db.begin() as s:
            a = own_assignment(s, assignment_id, host_id)
            _check_in_progress(a)
            a.upload_key = key
            states.move(a, AssignmentStatus.uploaded)
            a.uploaded_at = utcnow()
            # The examples are the work asked for, never the host's figure (which rode in the query string).
            a.examples = _asked_examples(s, a)
            a.train_loss, a.train_seconds = metrics.train_loss, metrics.seconds
            s.get_one(Host, host_id).last_seen = a.uploaded_at
    except BaseException:
        storage.delete(key)
        raise
    merge_stages.stamp(stamps, "recorded")
    log.info(
        "assignment %s: result uploaded (%d bytes, loss %s, %s examples reported), merge queued",
        assignment_id,
        upload.size,
        metrics.train_loss,
        metrics.examples,
        extra=ids(assignment_id=assignment_id, host_id=host_id),
    )
    # After the commit: the task must find the assignment uploaded. If this enqueue is lost, the
    # transitioner re-queues merges that stay uploaded too long.
    merge_stages.stamp(stamps, "queued")
    enqueue(assignment_id, stamps)
    return AssignmentStatus.uploaded
