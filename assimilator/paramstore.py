"""W_s in Redis: initialise, read, and merge exactly once per assignment.

W_s is one safetensors blob stored as fixed-size chunks (`keys.params_chunk`): Redis writes a
20 MB model about 4x faster as twenty 1 MB values than as one (benchmarks/merge_latency.py).

A merge is an optimistic transaction: WATCH the version and the merged-set, compute, then
MULTI/EXEC the new chunks, the new version and the assignment id together. Two parameter
servers racing on one job retry; a redelivered task finds its id in the merged-set and does
nothing. So every assignment is merged exactly once, however often its task runs.

When a job stops running, `close_merges` sets a flag that every merge transaction watches: after
it, the merged-set is final, and the ledger can end the job's other results knowing that none of
them will land in W_s later.
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from crowdtrain import keys
from crowdtrain.tensors import Params, decode, encode, views

CHUNK_BYTES = 1 << 20
NORMS_KEPT = 50  # accepted update norms remembered per job: the window of the norm bound's median


class MergesClosed(RuntimeError):
    """The job stopped running: its W_s takes no more merges."""


class NoServerModel(RuntimeError):
    """Redis holds no W_s for the job (never initialised, or Redis lost its data)."""


@dataclass(frozen=True)
class MergeOutcome:
    version: int  # version of W_s that includes this assignment
    applied_now: bool  # False when an earlier delivery already merged it


@dataclass
class _Cached:
    """The W_s this process wrote last: one safetensors buffer and numpy views into it.

    A merge updates the views in place, so the buffer is the new blob: no decode, no encode.
    """

    version: int
    blob: bytearray
    params: Params


# A parameter-server process runs one merge at a time; keeping its last W_s saves a 20 MB read.
_cache: dict[int, _Cached] = {}


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=60, health_check_interval=30)


def _chunk_count(size: int) -> int:
    return max(1, -(-size // CHUNK_BYTES))


def _queue_blob_write(pipe: redis.client.Pipeline, job_id: int, blob: bytes | bytearray) -> None:
    view = memoryview(blob)
    for i in range(_chunk_count(len(view))):
        pipe.set(keys.params_chunk(job_id, i), view[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])


def initialise(r: redis.Redis, job_id: int, params: Params, version: int = 0) -> None:
    """Set W_s and its version; does nothing if the job already has a server model."""
    initialise_blob(r, job_id, encode(params), version)


def has_server_model(r: redis.Redis, job_id: int) -> bool:
    return bool(r.exists(keys.version(job_id)))


def initialise_blob(r: redis.Redis, job_id: int, blob: bytes, version: int) -> bool:
    """Set W_s from safetensors bytes unless the job already has one; True if it was set."""
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(keys.version(job_id))
                if pipe.exists(keys.version(job_id)):
                    pipe.unwatch()
                    return False
                pipe.multi()
                _queue_blob_write(pipe, job_id, blob)
                pipe.set(keys.params_size(job_id), len(blob))
                pipe.set(keys.version(job_id), version)
                pipe.execute()
                return True
            except redis.WatchError:
                continue


def read_blob(r: redis.Redis, job_id: int) -> tuple[int, bytes]:
    """A consistent (version, safetensors blob) of W_s."""
    size = r.get(keys.params_size(job_id))
    if size is None:
        raise NoServerModel(f"job {job_id} has no server model in Redis")
    with r.pipeline(transaction=True) as pipe:
        pipe.get(keys.version(job_id))
        for i in range(_chunk_count(int(size))):
            pipe.get(keys.params_chunk(job_id, i))
        version, *chunks = pipe.execute()
    if version is None or any(c is None for c in chunks):
        raise NoServerModel(f"job {job_id} has an incomplete server model in Redis")
    return int(version), b"".join(chunks)


def read(r: redis.Redis, job_id: int) -> tuple[int, Params]:
    version, blob = read_blob(r, job_id)
    return version, decode(blob)


def merged_version(r: redis.Redis, job_id: int, assignment_id: int) -> int | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else int(json.loads(raw)["version"])


def recent_update_norms(r: redis.Redis, job_id: int) -> list[float]:
    """Norms of the job's last `NORMS_KEPT` merged updates, newest first."""
    return [float(v) for v in r.lrange(keys.update_norms(job_id), 0, -1)]


def merge_once(r: redis.Redis, job_id: int, assignment_id: int,
               merge: Callable[[Params, int], Params], received_at: float | None = None,
               update_norm: float | None = None) -> MergeOutcome:
    """Apply `merge(W_s, version)` exactly once for `assignment_id`.

    `merge` updates W_s in place (and returns it), or raises to refuse the result; either way
    nothing is written unless the whole transaction commits. Raises MergesClosed once the job's
    merges are closed. The merge also records
    `update_norm` among the recent ones and resets the job's count of failed merges. The norms
    change only together with the version, which is watched: `merge` may read them consistently.
    """
    vkey, mkey, lkey, member = keys.version(job_id), keys.merged(job_id), keys.merge_log(job_id), str(assignment_id)
    ckey = keys.closed(job_id)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(vkey, mkey, ckey)
                if pipe.sismember(mkey, member):
                    pipe.unwatch()
                    return MergeOutcome(merged_version(r, job_id, assignment_id) or 0, applied_now=False)
                if pipe.exists(ckey):
                    pipe.unwatch()
                    raise MergesClosed(f"job {job_id} is no longer running")
                raw_version = pipe.get(vkey)
                if raw_version is None:
                    raise NoServerModel(f"job {job_id} has no server model in Redis")
                version = int(raw_version)
                # Taken out of the cache while it is modified: a failed attempt must not leave it stale.
                state = _cache.pop(job_id, None)
                if state is None or state.version != version:
                    read_version, blob = read_blob(r, job_id)
                    if read_version != version:
                        continue  # another merge landed in between; start over
                    state = _Cached(version, bytearray(blob), {})
                    state.params = views(state.blob)
                new = merge(state.params, version)
                if any(new[k] is not state.params[k] for k in state.params):
                    raise ValueError("merge functions must update W_s in place")
                pipe.multi()
                _queue_blob_write(pipe, job_id, state.blob)
                pipe.set(vkey, version + 1)
                pipe.sadd(mkey, member)
                pipe.hset(lkey, member, json.dumps({"version": version + 1, "received_at": received_at}))
                if update_norm is not None:
                    pipe.lpush(keys.update_norms(job_id), update_norm)
                    pipe.ltrim(keys.update_norms(job_id), 0, NORMS_KEPT - 1)
                pipe.delete(keys.merge_failures(job_id))
                pipe.execute()
                merged_at = time.time()
                r.hset(lkey, member, json.dumps({"version": version + 1, "received_at": received_at,
                                                 "merged_at": merged_at}))
                state.version = version + 1
                _cache[job_id] = state
                return MergeOutcome(version + 1, applied_now=True)
            except redis.WatchError:
                continue


def close_merges(r: redis.Redis, job_id: int) -> set[int]:
    """Stop the job's merges for good; returns the assignment ids W_s holds, final from now on."""
    with r.pipeline() as pipe:  # MULTI: the flag and the read of the set are one step
        pipe.set(keys.closed(job_id), 1)
        pipe.smembers(keys.merged(job_id))
        _, merged = pipe.execute()
    return {int(m) for m in merged}


def reopen_merges(r: redis.Redis, job_id: int) -> None:
    """Undo close_merges when the job's end could not be recorded (it still runs)."""
    r.delete(keys.closed(job_id))


def count_merge_failure(r: redis.Redis, job_id: int) -> int:
    """Count one more merge that failed for good; returns how many failed since the last merge."""
    return int(r.incr(keys.merge_failures(job_id)))


def keep_snapshot(r: redis.Redis, job_id: int, version: int) -> None:
    """Put an expired snapshot back at the old end of the list: it is still in use."""
    r.rpush(keys.snapshots(job_id), version)


def note_snapshot(r: redis.Redis, job_id: int, version: int, keep: int) -> list[int]:
    """Record a published snapshot; returns the versions beyond the newest `keep`, to delete."""
    with r.pipeline() as pipe:
        pipe.lpush(keys.snapshots(job_id), version)
        pipe.lrange(keys.snapshots(job_id), keep, -1)
        pipe.ltrim(keys.snapshots(job_id), 0, keep - 1)
        _, expired, _ = pipe.execute()
    return [int(v) for v in expired]
