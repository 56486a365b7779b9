"""What a merge reads: the uploaded result, once, from where the scheduler stored it; the snapshot it
started from; the job's validation set.

The scheduler checked the upload before storing it (crowdtrain.server.services.results.check_result)
and, for a weights upload, recorded the digest of its W_c beside it. Then the bytes are read once
(mapped, where storage is a local directory), viewed without a copy, and neither checked nor hashed
again: the same W_c the scheduler checked is the one merged. A Δ upload (its W_c = W_base + Δ exists
only here), or an upload without a record (stored before records were kept, or after it expired), is
decoded and checked in full, and hashed here. Either way the replay digest of a result is taken once,
and ||Δ|| is summed in the same pass that forms Δ. No Celery and no ledger writes here.
"""

import mmap
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import redis

from crowdtrain.assimilator.rules import Update
from crowdtrain.assimilator.rules.update import params_norm, update_with_norm
from crowdtrain.core.digests import weights_digest
from crowdtrain.core.keys import snapshot_key, validation_key
from crowdtrain.core.storage import ObjectNotFound, Storage
from crowdtrain.core.tensors import (
    Params,
    TensorFormatError,
    check_against_manifest,
    check_layout,
    decode,
    decode_shard,
    header_limits,
    views,
)
from crowdtrain.core.updates import decode_update, upload_of
from crowdtrain.server.ledger import merges, result_records


class Refused(Exception):
    """The result must not be merged (stale, too large an update, malformed, its inputs gone).
    `charge`: whether the refusal counts against its workunit and host."""

    def __init__(self, reason: str, charge: bool):
        super().__init__(reason)
        self.reason, self.charge = reason, charge


@dataclass(frozen=True)
class Result:
    """One uploaded result, read: its update (staleness still 0), ||Δ||, ||W_base||, and the digest of its W_c."""

    update: Update
    norm: float
    base_norm: float
    digest: str


@lru_cache(maxsize=8)
def validation_set(storage: Storage, key: str) -> tuple[np.ndarray, np.ndarray]:
    return decode_shard(storage.get(key))


def holdout(storage: Storage, job_id: int, examples: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `examples` of the job's validation set: what replicas are measured on."""
    x, y = validation_set(storage, validation_key(job_id))
    return x[:examples], y[:examples]


@lru_cache(maxsize=4)
def _base_snapshot(storage: Storage, key: str) -> tuple[Params, float]:
    """A published W_s snapshot (read-only) and its norm: what results based on it are measured against."""
    params = decode(storage.get(key))
    return params, params_norm(params)


def read_result(storage: Storage, r: redis.Redis, p: merges.PendingMerge) -> Result:
    """The result of `p`, read once. Raises Refused, uncharged, when the upload or the snapshot it
    started from is gone, and, charged, when the upload is malformed (not the model's tensors, or
    not finite once applied)."""
    try:
        blob = _stored_upload(storage, p.upload_key)
    except ObjectNotFound:
        raise Refused(
            f"the upload {p.upload_key} is missing from storage; the workunit will be dispatched again", charge=False
        ) from None
    try:
        base, base_norm = _base_snapshot(storage, snapshot_key(p.job_id, p.base_version))
    except ObjectNotFound:
        raise Refused(
            f"the snapshot v{p.base_version} this result started from is gone, so its update cannot be "
            "checked; the workunit will be dispatched again",
            charge=False,
        ) from None
    upload = upload_of(p.spec["assimilation"])
    digest = result_records.checked_upload_digest(r, p.job_id, p.upload_key) if upload.send == "weights" else None
    try:
        if digest is not None:
            # Checked by the scheduler: the header is still parsed within its bounds, and the
            # layout compared (both cheap); the values are not scanned again.
            carried = views(blob, *header_limits(p.manifest))
            check_layout(carried, p.manifest)
        else:
            carried = decode_update(blob, p.manifest, upload)
        update, norm = update_with_norm(base, carried, upload.send, 0, p.epoch)
        if upload.send != "weights":
            check_against_manifest(update.client, p.manifest)  # W_base + Δ may overflow
    except (TensorFormatError, ValueError) as exc:
        raise Refused(f"invalid result: {exc}", charge=True) from None
    return Result(update, norm, base_norm, digest or weights_digest(update.client))


def _stored_upload(storage: Storage, key: str) -> bytes | memoryview:
    """The upload's bytes: mapped read-only where storage is a local directory, not copied (a stored
    object is only ever replaced or deleted, never changed: the mapping keeps what it mapped), else read."""
    path = storage.local_path(key)
    if path is None:
        return storage.get(key)
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""  # mmap cannot map nothing; refused below as not safetensors
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except FileNotFoundError:
        raise ObjectNotFound(key) from None


def replay_of(r: redis.Redis, job_id: int, assignment_id: int, digest: str) -> int | None:
    """The earlier assignment of the job whose result had exactly this W_c (a host uploading an old
    result again), else None; this result's digest is noted for those after it."""
    first = result_records.first_with_digest(r, job_id, digest, assignment_id)
    return None if first == assignment_id else first


def replay_reason(first: int) -> str:
    return f"its weights are those of assignment {first}'s result: a replayed result"
