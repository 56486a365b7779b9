"""Results as hosts send them: a result's upload checked once (its W_c's digest taken in the same pass),
written to storage while it is checked, recorded in the ledger as the assignment's upload
(crowdtrain.server.ledger.uploads) and its merge queued; a body refused for its content ends the
assignment `rejected`. Heartbeats, abandonments and error reports are the ledger's own procedures
(crowdtrain.server.ledger.assignments), served from here so that the routes call one service.

The merge queue is a parameter (`MergeQueue`): the process that serves the routes sets it up where it
starts (the parameter servers' Celery queue in the scheduler), so this layer imports no entry point."""

import math
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from datetime import datetime
from typing import Protocol

import redis
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys, merge_stages
from crowdtrain.core.assimilationspec import UploadSpec
from crowdtrain.core.digests import weights_digest
from crowdtrain.core.merge_stages import Stamps
from crowdtrain.core.schemas import MIN_HEARTBEAT_S, AssignmentOut, ResultMetrics, SnapshotBound
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.storage import Storage
from crowdtrain.core.tensors import TensorFormatError
from crowdtrain.core.updates import decode_update, upload_spec
from crowdtrain.server.ledger import assignments
from crowdtrain.server.ledger.assignments import ResultRefused, give_up, heartbeat_in, refuse_result
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.ledger.uploads import StoredUpload, record_upload, upload_target
from crowdtrain.server.services import file_refs
from crowdtrain.server.services.hosts import host_of_token

__all__ = [
    "MergeQueue",
    "ResultRefused",
    "accept_result",
    "bind_snapshot",
    "check_result",
    "give_up",
    "heartbeat_by_token",
    "refuse_result",
    "store_result",
    "upload_target",
]


class MergeQueue(Protocol):
    """Queues the merge of one uploaded result (assignment id, its stamps so far:
    crowdtrain.core.merge_stages); may be called more than once for the same id (merges are idempotent)."""

    def __call__(self, assignment_id: int, stamps: Stamps, /) -> None: ...


def bind_snapshot(
    db: sessionmaker[Session], storage: Storage, host_id: int, assignment_id: int, presign_seconds: int
) -> SnapshotBound:
    """The snapshot the host's assignment trains from, bound as its compute slot starts it
    (crowdtrain.server.ledger.assignments.bind_snapshot); its file when it is not the one dispatched."""
    b = assignments.bind_snapshot(db, host_id, assignment_id)
    if b.file is None:
        return SnapshotBound(base_version=b.version, snapshot=None)
    f = b.file
    ref = file_refs.snapshot_ref(storage, b.job_id, b.version, f.key, f.sha256, f.size, presign_seconds)
    return SnapshotBound(base_version=b.version, snapshot=ref)


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
    enqueue: MergeQueue,
    stamps: Stamps,
    evaluator: Evaluator,
) -> AssignmentStatus:
    """`check_result` and `store_result` for the upload target `upload_target` returned, with the
    check and the storage write at once (numpy, xxhash and file or socket writes release the GIL):
    the write no longer waits for the check. A body the check refuses (ResultRefused, raised again
    here) has its copy deleted first, and ends the assignment `rejected` (`refuse_result`; `evaluator`
    scores the final model if that ends the job): nothing of it stays, and nothing stored before is
    touched."""
    try:
        return _check_and_store(db, storage, r, host_id, assignment_id, target, body, metrics, enqueue, stamps)
    except ResultRefused as exc:
        refuse_result(db, storage, r, host_id, assignment_id, exc.message, evaluator)
        raise


def _check_and_store(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    host_id: int,
    assignment_id: int,
    target: tuple[int, dict, UploadSpec],
    body: bytes,
    metrics: ResultMetrics,
    enqueue: MergeQueue,
    stamps: Stamps,
) -> AssignmentStatus:
    job_id, manifest, upload = target
    key = _new_upload_key(job_id, assignment_id)
    writing = _store_threads.submit(storage.put, key, body)
    try:
        digest = check_result(body, manifest, upload)
        merge_stages.stamp(stamps, "checked")
    except BaseException:
        with suppress(Exception):  # a failed write stored nothing (puts are atomic)
            writing.result()
        storage.delete(key)
        raise
    writing.result()
    merge_stages.stamp(stamps, "stored")
    stored = StoredUpload(host_id, job_id, assignment_id, key, len(body))
    return record_upload(db, storage, r, stored, metrics, enqueue, digest, stamps)


def store_result(
    db: sessionmaker[Session],
    storage: Storage,
    host_id: int,
    job_id: int,
    assignment_id: int,
    body: bytes,
    metrics: ResultMetrics,
    enqueue: MergeQueue,
    *,
    r: redis.Redis | None = None,
    digest: str | None = None,
    stamps: Stamps | None = None,
) -> AssignmentStatus:
    """Store a checked result once and queue its merge (ResultProblem not_found/conflict otherwise).

    The body is written to storage under a key of its own before the (short) transaction, so the
    database's write lock is never held over the transfer; a losing concurrent upload deletes its copy.
    Given `digest` (what `check_result` returned for this body) and `r`, it is recorded under that
    key before the commit (result_records.note_checked_upload): the parameter server that merges the
    result reads the bytes once and neither checks nor hashes them again. Keyed by the upload, not
    the assignment, so two racing uploads of one assignment cannot pair one's bytes with the other's
    digest. `stamps`: the result's merge stages so far (crowdtrain.core.merge_stages; default: received now).
    """
    key = _new_upload_key(job_id, assignment_id)
    storage.put(key, body)
    stored = StoredUpload(host_id, job_id, assignment_id, key, len(body))
    return record_upload(db, storage, r, stored, metrics, enqueue, digest, stamps)


def _new_upload_key(job_id: int, assignment_id: int) -> str:
    return keys.upload_key(job_id, assignment_id, secrets.token_hex(4))


def heartbeat_interval(longest: float, given: Sequence[AssignmentOut], now: datetime) -> float:
    """The interval a work reply names for the heartbeats of the assignments it gives: the scheduler's
    `longest`, or a third of the shortest lease among them when that is sooner (a job whose
    `deadline_seconds` is under three intervals), so that a live host's work never times out between
    two heartbeats, never under MIN_HEARTBEAT_S unless `longest` is (a lease shorter than three of
    those is heartbeated at that pace all the same). Reckoned on the scheduler's clock: a host's clock
    may be minutes off."""
    shortest = min(((a.deadline - now).total_seconds() for a in given), default=math.inf)
    return min(longest, max(MIN_HEARTBEAT_S, shortest / 3))


def heartbeat_by_token(
    db: sessionmaker[Session], token: str, assignment_id: Callable[[], int]
) -> tuple[bool, str, datetime | None]:
    """A host's heartbeat in one transaction: the host authenticated by its bearer `token`
    (NotAuthorized if no live host's), then `assignment_id()` read (which may refuse the request:
    a wrong token is refused whatever the rest), then its heartbeat (crowdtrain.server.ledger.
    assignments.heartbeat: whether the work is still wanted, why not, its deadline now)."""
    with db.begin() as s:
        host_id = host_of_token(s, token)
        return heartbeat_in(s, host_id, assignment_id())
