"""W_s and its merge rule's state in Redis: initialise, read, and merge exactly once per assignment.

W_s is one safetensors blob stored as fixed-size chunks (`keys.params_chunk`): Redis writes a
20 MB model about 4x faster as twenty 1 MB values than as one (benchmarks/merge_latency.py). The
rule's state (an outer optimizer's momentum, FedBuff's buffer: named arrays of fixed shapes) is a
second blob stored the same way (`keys.rule_state_chunk`), created from the rule's
`initial_state(W_s)` by the first merge that finds none.

A merge is an optimistic transaction: WATCH the version and the merged-set, compute, then
MULTI/EXEC the new chunks of W_s and of the rule's state, the new version and the assignment id
together. Two parameter servers racing on one job retry; a redelivered task finds its id in the
merged-set and does nothing. So every assignment is merged exactly once, however often its task
runs, and its effect on the rule's state (one momentum step, one buffered update) too. Given the
assignment's workunit, the transaction also watches the workunit -> assignment map: of a straggler
and its duplicate, the first to merge is the only one W_s takes. The state
is written only together with the version, so watching the version covers it.

When a job stops running, `close_merges` sets a flag that every merge transaction watches: after
it, the merged-set is final, and the ledger can end the job's other results knowing that none of
them will land in W_s later.
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.connection import Encoder, PythonRespSerializer

from crowdtrain.core import keys
from crowdtrain.core.tensors import Params, decode, encode, views

CHUNK_BYTES = 1 << 20
_BUFFER_CUTOFF = 6000  # redis-py's: values longer than this are sent as buffers of their own
NORMS_KEPT = 50  # accepted update norms remembered per job: the window of the norm bound's median

Merge = Callable[[Params, Params, int], Params]  # (W_s, rule state, version) -> W_s, both changed in place


class MergesClosed(RuntimeError):
    """The job stopped running: its W_s takes no more merges."""


class WorkunitMerged(RuntimeError):
    """W_s already holds another assignment's result for this workunit (`assignment_id`)."""

    def __init__(self, workunit_id: int, assignment_id: int):
        super().__init__(f"workunit {workunit_id} was merged from assignment {assignment_id}")
        self.assignment_id = assignment_id


class NoServerModel(RuntimeError):
    """Redis holds no W_s for the job (never initialised, or Redis lost its data)."""


@dataclass(frozen=True)
class MergeOutcome:
    version: int  # version of W_s that includes this assignment
    applied_now: bool  # False when an earlier delivery already merged it


@dataclass
class _Cached:
    """The W_s and rule state this process wrote last: safetensors buffers and numpy views into them.

    A merge updates the views in place, so the buffers are the new blobs: no decode, no encode.
    """

    version: int
    blob: bytearray
    params: Params
    state_blob: bytearray
    state: Params


# A parameter-server process runs one merge at a time; keeping its last W_s saves a 20 MB read.
_cache: dict[int, _Cached] = {}


def connect(url: str) -> redis.Redis:
    # redis-py's pure-Python packer sends a large value as its own buffer; the hiredis packer it
    # prefers copies every value into one command buffer (3-4x slower for the 1-8 MB values here).
    packer = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)
    pool = redis.ConnectionPool.from_url(url, socket_timeout=60, health_check_interval=30, command_packer=packer)
    return redis.Redis(connection_pool=pool)


def _chunk_count(size: int) -> int:
    return max(1, -(-size // CHUNK_BYTES))


def _queue_blob_write(
    pipe: redis.client.Pipeline,
    job_id: int,
    blob: bytes | bytearray,
    chunk_key: Callable[[int, int], str] = keys.params_chunk,
) -> None:
    view = memoryview(blob)
    for i in range(_chunk_count(len(view))):
        pipe.set(chunk_key(job_id, i), view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])


def _queue_state_write(pipe: redis.client.Pipeline, job_id: int, blob: bytes | bytearray) -> None:
    _queue_blob_write(pipe, job_id, blob, keys.rule_state_chunk)
    pipe.set(keys.rule_state_size(job_id), len(blob))


def initialise(r: redis.Redis, job_id: int, params: Params, version: int = 0, state: Params | None = None) -> None:
    """Set W_s, its version and (when given) the rule's state; does nothing if the job already has a
    server model. Without `state`, the first merge creates it from the rule's initial_state(W_s)."""
    initialise_blob(r, job_id, encode(params), version, None if state is None else encode(state))


def has_server_model(r: redis.Redis, job_id: int) -> bool:
    return bool(r.exists(keys.version(job_id)))


def initialise_blob(r: redis.Redis, job_id: int, blob: bytes, version: int, state_blob: bytes | None = None) -> bool:
    """Set W_s from safetensors bytes unless the job already has one; True if it was set.

    The rule's state is set to `state_blob`, or, without one, removed: a state left from an older
    W_s (Redis lost the version but not everything) would not belong to this one.
    """
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(keys.version(job_id), keys.rule_state_size(job_id))
                if pipe.exists(keys.version(job_id)):
                    pipe.unwatch()
                    return False
                old_state_size = pipe.get(keys.rule_state_size(job_id))
                pipe.multi()
                _queue_blob_write(pipe, job_id, blob)
                pipe.set(keys.params_size(job_id), len(blob))
                if old_state_size is not None:
                    pipe.delete(*(keys.rule_state_chunk(job_id, i) for i in range(_chunk_count(int(old_state_size)))))
                    pipe.delete(keys.rule_state_size(job_id))
                if state_blob is not None:
                    _queue_state_write(pipe, job_id, state_blob)
                pipe.set(keys.version(job_id), version)
                pipe.execute()
                return True
            except redis.WatchError:
                continue


def read_blob(r: redis.Redis, job_id: int) -> tuple[int, bytes]:
    """A consistent (version, safetensors blob) of W_s."""
    version, blob, _ = _read_blobs(r, job_id, with_state=False)
    return version, blob


def read(r: redis.Redis, job_id: int) -> tuple[int, Params]:
    version, blob = read_blob(r, job_id)
    return version, decode(blob)


def read_state(r: redis.Redis, job_id: int) -> tuple[int, Params | None]:
    """A consistent (version, rule state) of the job; the state is None until a merge created it."""
    version, _, state_blob = _read_blobs(r, job_id, with_state=True)
    return version, None if state_blob is None else decode(state_blob)


def read_with_state(r: redis.Redis, job_id: int) -> tuple[int, Params, Params | None]:
    """A consistent (version, W_s, rule state or None) in one read, as read-only views of the bytes."""
    version, blob, state_blob = _read_blobs(r, job_id, with_state=True)
    return version, views(blob), None if state_blob is None else views(state_blob)


def _read_blobs(r: redis.Redis, job_id: int, with_state: bool) -> tuple[int, bytes, bytes | None]:
    """(version, W_s blob, rule-state blob or None) read in one MULTI, so all three belong together
    (the sizes, read first, change only when the version does: a caller comparing versions sees it)."""
    size, state_size = r.mget(keys.params_size(job_id), keys.rule_state_size(job_id))
    if size is None:
        raise NoServerModel(f"job {job_id} has no server model in Redis")
    n = _chunk_count(int(size))
    n_state = _chunk_count(int(state_size)) if with_state and state_size is not None else 0
    with r.pipeline(transaction=True) as pipe:
        pipe.get(keys.version(job_id))
        for i in range(n):
            pipe.get(keys.params_chunk(job_id, i))
        for i in range(n_state):
            pipe.get(keys.rule_state_chunk(job_id, i))
        version, *chunks = pipe.execute()
    if version is None or any(c is None for c in chunks):
        raise NoServerModel(f"job {job_id} has an incomplete server model in Redis")
    return int(version), b"".join(chunks[:n]), b"".join(chunks[n:]) if n_state else None


def merged_version(r: redis.Redis, job_id: int, assignment_id: int) -> int | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else int(json.loads(raw)["version"])


def _while_open(r: redis.Redis, job_id: int, queue: Callable[[redis.client.Pipeline], object]) -> list | None:
    """Run the commands `queue` adds to a MULTI unless the job's merges are closed (its end deletes
    what they write: `forget_finished`, which a later write would bring back); their replies, or None."""
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(keys.closed(job_id))
                if pipe.exists(keys.closed(job_id)):
                    pipe.unwatch()
                    return None
                pipe.multi()
                queue(pipe)
                return pipe.execute()
            except redis.WatchError:
                continue


def first_with_digest(r: redis.Redis, job_id: int, digest: str, assignment_id: int) -> int:
    """The assignment that first brought a result whose W_c has this digest: `assignment_id`, recorded
    now, unless an earlier one did (asking again for the same assignment changes nothing). Once the
    job's merges are closed nothing is recorded, and `assignment_id` is returned (it merges nothing)."""
    key = keys.result_digests(job_id)

    def queue(pipe: redis.client.Pipeline) -> None:
        pipe.hsetnx(key, digest, assignment_id)
        pipe.hget(key, digest)

    replies = _while_open(r, job_id, queue)
    return assignment_id if replies is None else int(replies[1] or assignment_id)


CHECKED_UPLOAD_SECONDS = 7 * 24 * 3600  # after that, an upload still unmerged is checked again in full


def note_checked_upload(r: redis.Redis, job_id: int, upload_key: str, digest: str) -> None:
    """Record that the upload stored under `upload_key` was checked and carries W_c with `digest`."""
    r.set(keys.checked_upload(job_id, upload_key), digest, ex=CHECKED_UPLOAD_SECONDS)


def checked_upload_digest(r: redis.Redis, job_id: int, upload_key: str) -> str | None:
    """The digest `note_checked_upload` recorded for the upload, or None (never checked so, or expired)."""
    raw = r.get(keys.checked_upload(job_id, upload_key))
    return None if raw is None else keys.text(raw)


def forget_checked_upload(r: redis.Redis, job_id: int, upload_key: str) -> None:
    r.delete(keys.checked_upload(job_id, upload_key))


def recent_update_norms(r: redis.Redis, job_id: int) -> list[float]:
    """Norms of the job's last `NORMS_KEPT` merged updates, newest first."""
    return [float(v) for v in r.lrange(keys.update_norms(job_id), 0, -1)]


def merge_once(
    r: redis.Redis,
    job_id: int,
    assignment_id: int,
    merge: Merge,
    received_at: float | None = None,
    update_norm: float | None = None,
    initial_state: Callable[[Params], Params] | None = None,
    workunit_id: int | None = None,
) -> MergeOutcome:
    """Apply `merge(W_s, state, version)` exactly once for `assignment_id`, and, given its
    `workunit_id`, at most once per workunit: when W_s already holds another assignment of the
    workunit (a straggler and its duplicate both uploaded), raises WorkunitMerged, writing nothing.

    `merge` updates W_s and the rule's state in place (and returns W_s), or raises to refuse the
    result; either way nothing is written unless the whole transaction commits, and W_s, the
    state, the version and the merged-set change together. When Redis holds no state yet, it
    starts as `initial_state(W_s)` (empty without one). Raises MergesClosed once the job's merges
    are closed. The merge also records `update_norm` among the recent ones and resets the job's
    count of failed merges. The norms change only together with the version, which is watched:
    `merge` may read them consistently.
    """
    vkey, mkey, lkey, member = keys.version(job_id), keys.merged(job_id), keys.merge_log(job_id), str(assignment_id)
    ckey, wkey = keys.closed(job_id), keys.merged_workunits(job_id)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(vkey, mkey, ckey, wkey)
                if pipe.sismember(mkey, member):
                    pipe.unwatch()
                    return MergeOutcome(merged_version(r, job_id, assignment_id) or 0, applied_now=False)
                if pipe.exists(ckey):
                    pipe.unwatch()
                    raise MergesClosed(f"job {job_id} is no longer running")
                if workunit_id is not None and (owner := pipe.hget(wkey, str(workunit_id))) is not None:
                    pipe.unwatch()
                    raise WorkunitMerged(workunit_id, int(owner))
                raw_version = pipe.get(vkey)
                if raw_version is None:
                    raise NoServerModel(f"job {job_id} has no server model in Redis")
                version = int(raw_version)
                # Taken out of the cache while it is modified: a failed attempt must not leave it stale.
                cached = _cache.pop(job_id, None)
                if cached is None or cached.version != version:
                    cached = _load(r, job_id, initial_state)
                    if cached.version != version:
                        continue  # another merge landed in between; start over
                params, state = dict(cached.params), dict(cached.state)
                new = merge(cached.params, cached.state, version)
                if (
                    any(new[k] is not params[k] for k in params)
                    or cached.state.keys() != state.keys()
                    or any(cached.state[k] is not state[k] for k in state)
                ):
                    raise ValueError("merge functions must update W_s and the rule's state in place")
                pipe.multi()
                _queue_blob_write(pipe, job_id, cached.blob)
                _queue_state_write(pipe, job_id, cached.state_blob)
                pipe.set(vkey, version + 1)
                pipe.sadd(mkey, member)
                if workunit_id is not None:
                    pipe.hset(wkey, str(workunit_id), member)
                pipe.hset(lkey, member, json.dumps({"version": version + 1, "received_at": received_at}))
                if update_norm is not None:
                    pipe.lpush(keys.update_norms(job_id), update_norm)
                    pipe.ltrim(keys.update_norms(job_id), 0, NORMS_KEPT - 1)
                pipe.delete(keys.merge_failures(job_id))
                pipe.execute()
                merged_at = time.time()
                r.hset(
                    lkey,
                    member,
                    json.dumps({"version": version + 1, "received_at": received_at, "merged_at": merged_at}),
                )
                cached.version = version + 1
                _cache[job_id] = cached
                return MergeOutcome(version + 1, applied_now=True)
            except redis.WatchError:
                continue


def _load(r: redis.Redis, job_id: int, initial_state: Callable[[Params], Params] | None) -> _Cached:
    """W_s and the rule's state as Redis holds them, as writable views; a state Redis lacks is made
    from `initial_state(W_s)` (and written by the merge that made it)."""
    version, blob, state_blob = _read_blobs(r, job_id, with_state=True)
    cached = _Cached(version, bytearray(blob), {}, bytearray(), {})
    cached.params = views(cached.blob)
    if state_blob is None:
        state_blob = encode(initial_state(cached.params) if initial_state is not None else {})
    cached.state_blob = bytearray(state_blob)
    cached.state = views(cached.state_blob)
    return cached


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
    """Count one more merge in a row that failed; returns the count (0, counting nothing, once the
    job's merges are closed: no count can fail it then)."""
    replies = _while_open(r, job_id, lambda pipe: pipe.incr(keys.merge_failures(job_id)))
    return 0 if replies is None else int(replies[0])


def forget_finished(r: redis.Redis, job_id: int) -> None:
    """Delete what only a running job's merges read, once its end is committed: the digests of its
    results (replays), the norms of its recent updates, its count of failed merges, and which
    assignment W_s took each workunit from. Kept: the closed flag, the merged set and the merge log
    (a late merge task records what W_s holds from them) and W_s itself (exported; a late task reads it)."""
    r.delete(
        keys.result_digests(job_id),
        keys.update_norms(job_id),
        keys.merge_failures(job_id),
        keys.merged_workunits(job_id),
    )


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
