"""W_s and its merge rule's state in Redis: initialise, read, and merge exactly once per assignment.

W_s is one safetensors blob stored as fixed-size chunks (`keys.params_chunk`): Redis writes a
20 MB model about 4x faster as twenty 1 MB values than as one (benchmarks/merge_latency.py). The
rule's state (an outer optimizer's momentum, FedBuff's buffer: named arrays of fixed shapes) is a
second blob stored the same way (`keys.rule_state_chunk`), created from the rule's
`initial_state(W_s)` by the first merge that finds none.

A merge pass is an optimistic transaction: WATCH the version and the merged-set, apply the pass's
results in order to W_s read once (crowdtrain.server.paramstore.steps), then MULTI/EXEC the new
chunks of W_s and of the rule's state, the new version and every merged assignment id together.
Two parameter servers racing on one job retry; a redelivered task finds its id in the merged-set
and does nothing. So every assignment is merged exactly once, however often its task runs and
whichever pass takes it, and its effect on the rule's state (one momentum step, one buffered update)
too. The transaction also watches the workunit -> assignment map: of a straggler and its duplicate,
the first to merge is the only one W_s takes. The state is written only with the version, so
watching the version covers it.

A parameter-server process keeps the W_s it wrote last, with the random tag written beside it
(`keys.params_tag`); a merge that finds that tag in Redis reads only the small keys, not W_s. Any
other write of W_s (another process's merge, a restore) writes another tag, and the next merge here
reads W_s again. Which process merges a job's results is the merge lease's concern
(crowdtrain.server.paramstore.lease); nothing here rests on it.

When a job stops running, `close_merges` sets a flag that every merge transaction watches: after
it, the merged-set is final, and the ledger can end the job's other results knowing that none of
them will land in W_s later.
"""

import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import redis
from redis.connection import Encoder, PythonRespSerializer
from redis.typing import EncodableT

from crowdtrain.core import keys
from crowdtrain.core.tensors import Params, decode, encode, views
from crowdtrain.server.paramstore import cache
from crowdtrain.server.paramstore.cache import CachedModel
from crowdtrain.server.paramstore.steps import NORMS_KEPT, Pass, QueuedResult, Taken, Taking

CHUNK_BYTES = 1 << 20
_BUFFER_CUTOFF = 6000  # redis-py's: values longer than this are sent as buffers of their own

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
                pipe.set(keys.params_tag(job_id), _new_tag())
                pipe.execute()
                return True
            except redis.WatchError:
                continue


def read_blob(r: redis.Redis, job_id: int) -> tuple[int, bytes]:
    """A consistent (version, safetensors blob) of W_s."""
    blobs = _read_blobs(r, job_id, with_state=False)
    return blobs.version, blobs.params


def read(r: redis.Redis, job_id: int) -> tuple[int, Params]:
    version, blob = read_blob(r, job_id)
    return version, decode(blob)


def read_state(r: redis.Redis, job_id: int) -> tuple[int, Params | None]:
    """A consistent (version, rule state) of the job; the state is None until a merge created it."""
    blobs = _read_blobs(r, job_id, with_state=True)
    return blobs.version, None if blobs.state is None else decode(blobs.state)


def read_with_state(r: redis.Redis, job_id: int) -> tuple[int, Params, Params | None]:
    """A consistent (version, W_s, rule state or None) in one read, as read-only views of the bytes."""
    blobs = _read_blobs(r, job_id, with_state=True)
    return blobs.version, views(blobs.params), None if blobs.state is None else views(blobs.state)


@dataclass(frozen=True)
class _Blobs:
    version: int
    tag: str | None
    params: bytes
    state: bytes | None


def _read_blobs(r: redis.Redis, job_id: int, with_state: bool) -> _Blobs:
    """W_s's version, tag, blob and (`with_state`) the rule-state blob or None, read in one MULTI, so
    all belong together (the sizes, read first, change only when the version does: a caller comparing
    versions sees it)."""
    size, state_size = r.mget(keys.params_size(job_id), keys.rule_state_size(job_id))
    if size is None:
        raise NoServerModel(f"job {job_id} has no server model in Redis")
    n = _chunk_count(int(size))
    n_state = _chunk_count(int(state_size)) if with_state and state_size is not None else 0
    with r.pipeline(transaction=True) as pipe:
        pipe.mget(keys.version(job_id), keys.params_tag(job_id))
        for i in range(n):
            pipe.get(keys.params_chunk(job_id, i))
        for i in range(n_state):
            pipe.get(keys.rule_state_chunk(job_id, i))
        (version, tag), *chunks = pipe.execute()
    if version is None or any(c is None for c in chunks):
        raise NoServerModel(f"job {job_id} has an incomplete server model in Redis")
    state = b"".join(chunks[n:]) if n_state else None
    return _Blobs(int(version), None if tag is None else keys.text(tag), b"".join(chunks[:n]), state)


def merged_version(r: redis.Redis, job_id: int, assignment_id: int) -> int | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else int(json.loads(raw)["version"])


def while_open(r: redis.Redis, job_id: int, queue: Callable[[redis.client.Pipeline], object]) -> list | None:
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
    result; either way nothing is written unless the whole transaction commits. A pass of one
    result (`merge_batch`, which says the rest).
    """

    def step(server: Params, state: Params, version: int, _norms: Sequence[float]) -> None:
        if merge(server, state, version) is not server:
            raise ValueError("merge functions must update W_s and the rule's state in place")

    queued = QueuedResult(assignment_id, step, received_at, update_norm, workunit_id)
    [taking] = merge_batch(r, job_id, [queued], initial_state)
    if taking.taken is Taken.superseded:
        raise WorkunitMerged(cast(int, workunit_id), cast(int, taking.winner))
    assert taking.version is not None  # a step that raises is merge_once's only refusal
    return MergeOutcome(taking.version, applied_now=taking.taken is Taken.merged)


def merge_batch(
    r: redis.Redis,
    job_id: int,
    results: Sequence[QueuedResult],
    initial_state: Callable[[Params], Params] | None = None,
) -> list[Taking]:
    """Merge `results` in order, each exactly once, into W_s read once and written once: what each became.

    Each result's step runs on W_s and the rule's state as the results before it left them, with
    the version and recent update norms they left (crowdtrain.server.paramstore.steps), so k
    results in one pass equal k single merges. W_s, the state, the version, the recent norms and
    every merged assignment id (the merged-set, the workunit map, the merge log) change together
    in one MULTI/EXEC, or not at all. A result W_s already holds is `already_merged`; one whose
    workunit W_s holds from another assignment, `superseded`; one its step refuses, `refused`.
    When Redis holds no state yet, it starts as `initial_state(W_s)` (empty without one). Raises
    MergesClosed once the job's merges are closed, and whatever a step raises, writing nothing.
    """
    with r.pipeline() as pipe:
        while True:
            try:
                takings = _merge_attempt(r, pipe, job_id, results, initial_state)
            except redis.WatchError:
                continue
            if takings is not None:
                return takings


def _merge_attempt(
    r: redis.Redis,
    pipe: redis.client.Pipeline,
    job_id: int,
    results: Sequence[QueuedResult],
    initial_state: Callable[[Params], Params] | None,
) -> list[Taking] | None:
    """One optimistic try: what each result became, or None to try again (W_s moved while it was
    read); raises WatchError when the EXEC lost to another write."""
    vkey, members = keys.version(job_id), [str(q.assignment_id) for q in results]
    pipe.watch(vkey, keys.merged(job_id), keys.closed(job_id), keys.merged_workunits(job_id))
    # Read on another connection, in one round trip: a change after the WATCH fails the EXEC anyway.
    with r.pipeline(transaction=False) as reads:
        reads.smismember(keys.merged(job_id), members)
        reads.exists(keys.closed(job_id))
        reads.hmget(keys.merged_workunits(job_id), [str(q.workunit_id) for q in results])
        reads.mget(vkey, keys.params_tag(job_id))
        reads.lrange(keys.update_norms(job_id), 0, -1)
        merged, closed, owners, (raw_version, raw_tag), norms = reads.execute()
    if closed or raw_version is None:
        pipe.unwatch()
        if closed:
            raise MergesClosed(f"job {job_id} is no longer running")
        raise NoServerModel(f"job {job_id} has no server model in Redis")
    settled = {q.assignment_id: _settled(r, job_id, q, m, o) for q, m, o in zip(results, merged, owners, strict=True)}
    todo = [q for q in results if settled[q.assignment_id] is None]
    version, tag = int(raw_version), None if raw_tag is None else keys.text(raw_tag)
    cached = cache.take(job_id, tag) if todo else None
    if todo and cached is None:
        blobs = _read_blobs(r, job_id, with_state=True)
        cached = CachedModel.of(blobs.tag, blobs.version, blobs.params, blobs.state, initial_state)
        if (cached.version, cached.tag) != (version, tag):
            pipe.unwatch()
            return None  # another merge landed in between; start over
    if cached is None:
        pipe.unwatch()
        return [cast(Taking, settled[q.assignment_id]) for q in results]
    merging = Pass(cached, version, [float(n) for n in norms])
    settled |= {q.assignment_id: merging.apply(q) for q in todo}
    if merging.merged:
        pipe.multi()
        _queue_merge_writes(pipe, job_id, merging)
        pipe.execute()
        merged_at = time.time()
        log: dict[EncodableT, EncodableT] = {
            str(q.assignment_id): _log_entry(v, q.received_at, merged_at) for q, v in merging.merged
        }
        r.hset(keys.merge_log(job_id), mapping=log)
    else:
        pipe.unwatch()
    cache.keep(job_id, cached)  # written, or unchanged: every step refused
    return [cast(Taking, settled[q.assignment_id]) for q in results]


def _settled(r: redis.Redis, job_id: int, q: QueuedResult, merged: int, owner: bytes | None) -> Taking | None:
    """What a result already is before the pass (merged by an earlier one, or its workunit from
    another assignment), or None when the pass is to merge it."""
    if merged:
        return Taking(q.assignment_id, Taken.already_merged, merged_version(r, job_id, q.assignment_id) or 0)
    if q.workunit_id is not None and owner is not None:
        return Taking(q.assignment_id, Taken.superseded, winner=int(owner))
    return None


def _log_entry(version: int, received_at: float | None, merged_at: float | None = None) -> str:
    entry = {"version": version, "received_at": received_at}
    return json.dumps(entry if merged_at is None else entry | {"merged_at": merged_at})


def _queue_merge_writes(pipe: redis.client.Pipeline, job_id: int, merging: Pass) -> None:
    """The MULTI of a pass: W_s, its state, version and new tag once, and the records of every merged assignment."""
    cached = merging.model
    cached.version, cached.tag = merging.version, _new_tag()
    _queue_blob_write(pipe, job_id, cached.blob)
    _queue_state_write(pipe, job_id, cached.state_blob)
    pipe.set(keys.version(job_id), merging.version)
    pipe.set(keys.params_tag(job_id), cached.tag)
    pipe.sadd(keys.merged(job_id), *(str(q.assignment_id) for q, _ in merging.merged))
    workunits: dict[EncodableT, EncodableT] = {
        str(q.workunit_id): str(q.assignment_id) for q, _ in merging.merged if q.workunit_id is not None
    }
    if workunits:
        pipe.hset(keys.merged_workunits(job_id), mapping=workunits)
    log: dict[EncodableT, EncodableT] = {str(q.assignment_id): _log_entry(v, q.received_at) for q, v in merging.merged}
    pipe.hset(keys.merge_log(job_id), mapping=log)
    norms = [q.update_norm for q, _ in merging.merged if q.update_norm is not None]
    if norms:
        pipe.lpush(keys.update_norms(job_id), *norms)
        pipe.ltrim(keys.update_norms(job_id), 0, NORMS_KEPT - 1)
    pipe.delete(keys.merge_failures(job_id))


def _new_tag() -> str:
    return secrets.token_hex(8)


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
    replies = while_open(r, job_id, lambda pipe: pipe.incr(keys.merge_failures(job_id)))
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
        keys.merges_wanted(job_id),
    )
