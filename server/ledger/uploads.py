"""A host's result upload: checked once (its W_c's digest taken in the same pass), written to storage
while it is checked, recorded as the assignment's upload, and its merge queued. A body refused for its
content ends the assignment `rejected` (crowdtrain.server.ledger.assignments.refuse_result)."""

import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass

import redis
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys
from crowdtrain.core.credit import assigned_examples
from crowdtrain.core.digests import weights_digest
from crowdtrain.core.jobspec import UploadSpec
from crowdtrain.core.logs import ids
from crowdtrain.core.refusals import RefusalKind
from crowdtrain.core.schemas import ResultMetrics
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.storage import Storage
from crowdtrain.core.tensors import TensorFormatError
from crowdtrain.core.updates import decode_update, upload_of, upload_spec
from crowdtrain.server.ledger import result_records, states
from crowdtrain.server.ledger.assignments import ResultProblem, ResultRefused, own_assignment
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


def check_result(body: bytes, manifest: dict, upload: UploadSpec | dict | None = None) -> str | None:
    """Raise ResultRefused unless `body` is a result encoded as `upload` says (default: weights as
    float32) for a model with `manifest`: names, shapes, the encoding's dtypes, scales, finite decoded
    values (crowdtrain.core.updates.decode_update). The header is bounded before it is parsed. No I/O.

    Returns the digest of the W_c a weights upload carries (crowdtrain.core.digests), taken in the
    same pass, for `store_result` to record; None for a Δ upload, whose W_c = W_base + Δ only the
    parameter server, which holds W_base, can form."""
    try:
        carried = decode_update(body, manifest, upload)
    except (TensorFormatError, ValueError) as exc:
        raise ResultRefused(f"result rejected: {exc}") from exc
    return weights_digest(carried) if upload_spec(upload).send == "weights" else None


# Uploads are written to storage from these threads while the scheduler checks them (accept_result).
_store_threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="upload-store")


def accept_result(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    host_id: int,
    assignment_id: int,
    target: tuple[int, dict, UploadSpec],
    body: bytes,
    metrics: ResultMetrics,
    enqueue: Callable[[int, float], None],
    received_at: float,
) -> AssignmentStatus:
    """`check_result` and `store_result` for the upload target `upload_target` returned, with the
    check and the storage write at once (numpy, xxhash and file or socket writes release the GIL):
    the write no longer waits for the check. A body the check refuses (ResultRefused) has its copy
    deleted first: nothing of it stays, and nothing stored before is touched."""
    job_id, manifest, upload = target
    key = _new_upload_key(job_id, assignment_id)
    writing = _store_threads.submit(storage.put, key, body)
    try:
        digest = check_result(body, manifest, upload)
    except BaseException:
        with suppress(Exception):  # a failed write stored nothing (puts are atomic)
            writing.result()
        storage.delete(key)
        raise
    writing.result()
    stored = _StoredUpload(host_id, job_id, assignment_id, key, len(body))
    return _record_upload(db, storage, r, stored, metrics, enqueue, digest, received_at)


def store_result(
    db: sessionmaker[Session],
    storage: Storage,
    host_id: int,
    job_id: int,
    assignment_id: int,
    body: bytes,
    metrics: ResultMetrics,
    enqueue: Callable[[int, float], None],
    *,
    r: redis.Redis | None = None,
    digest: str | None = None,
    received_at: float | None = None,
) -> AssignmentStatus:
    """Store a checked result once and queue its merge (ResultProblem not_found/conflict otherwise).

    The body is written to storage under a key of its own before the (short) transaction, so the
    database's write lock is never held over the transfer; a losing concurrent upload deletes its copy.
    Given `digest` (what `check_result` returned for this body) and `r`, it is recorded under that
    key before the commit (result_records.note_checked_upload): the parameter server that merges the
    result reads the bytes once and neither checks nor hashes them again. Keyed by the upload, not
    the assignment, so two racing uploads of one assignment cannot pair one's bytes with the other's
    digest. `received_at`: when the body was in hand (default: now), where a merge's latency starts.
    """
    key = _new_upload_key(job_id, assignment_id)
    storage.put(key, body)
    stored = _StoredUpload(host_id, job_id, assignment_id, key, len(body))
    return _record_upload(db, storage, r, stored, metrics, enqueue, digest, received_at)


def _new_upload_key(job_id: int, assignment_id: int) -> str:
    return keys.upload_key(job_id, assignment_id, secrets.token_hex(4))


@dataclass(frozen=True)
class _StoredUpload:
    host_id: int
    job_id: int
    assignment_id: int
    key: str  # where the body is stored
    size: int


def _asked_examples(s: Session, a: Assignment) -> int:
    """The examples `a` was asked to train (crowdtrain.core.credit.assigned_examples)."""
    shard = s.get_one(Shard, s.get_one(Workunit, a.workunit_id).shard_id)
    local_epochs = s.get_one(Job, a.job_id).spec["training"]["local_epochs"]
    return assigned_examples(shard.examples, local_epochs, a.local_fraction)


def _record_upload(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis | None,
    upload: _StoredUpload,
    metrics: ResultMetrics,
    enqueue: Callable[[int, float], None],
    digest: str | None,
    received_at: float | None,
) -> AssignmentStatus:
    """The second half of `store_result`, for a body already stored (and deleted here on failure)."""
    received_at = time.time() if received_at is None else received_at
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
    enqueue(assignment_id, received_at)
    return AssignmentStatus.uploaded
