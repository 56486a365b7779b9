"""W_s and its merge rule's state in Redis: initialise and read them, and close a job's merges.

W_s is one safetensors blob stored as fixed-size chunks (`keys.params_chunk`): Redis writes a
20 MB model about 4x faster as twenty 1 MB values than as one (benchmarks/merge_latency.py). The
rule's state (an outer optimizer's momentum, FedBuff's buffer: named arrays of fixed shapes) is a
second blob stored the same way (`keys.rule_state_chunk`), created from the rule's
`initial_state(W_s)` by the first merge that finds none.

Results are merged into them exactly once (crowdtrain.server.paramstore.merging).

When a job stops running, `close_merges` sets a flag that every merge transaction watches: after
it, the merged-set is final, and the ledger can end the job's other results knowing that none of
them will land in W_s later.
"""

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.connection import Encoder, PythonRespSerializer

from crowdtrain.core import keys
from crowdtrain.core.tensors import Params, decode, encode, views

CHUNK_BYTES = 1 << 20
_BUFFER_CUTOFF = 6000  # redis-py's: values longer than this are sent as buffers of their own


class NoServerModel(RuntimeError):
    """Redis holds no W_s for the job (never initialised, or Redis lost its data)."""


def connect(url: str) -> redis.Redis:
    # redis-py's pure-Python packer sends a large value as its own buffer; the hiredis packer it
    # prefers copies every value into one command buffer (3-4x slower for the 1-8 MB values here).
    packer = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)
    pool = redis.ConnectionPool.from_url(url, socket_timeout=60, health_check_interval=30, command_packer=packer)
    return redis.Redis(connection_pool=pool)


def _chunk_count(size: int) -> int:
    return max(1, -(-size // CHUNK_BYTES))


def queue_blob_write(
    pipe: redis.client.Pipeline,
    job_id: int,
    blob: bytes | bytearray,
    chunk_key: Callable[[int, int], str] = keys.params_chunk,
) -> None:
    view = memoryview(blob)
    for i in range(_chunk_count(len(view))):
        pipe.set(chunk_key(job_id, i), view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])


def queue_state_write(pipe: redis.client.Pipeline, job_id: int, blob: bytes | bytearray) -> None:
    queue_blob_write(pipe, job_id, blob, keys.rule_state_chunk)
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
                queue_blob_write(pipe, job_id, blob)
                pipe.set(keys.params_size(job_id), len(blob))
                if old_state_size is not None:
                    pipe.delete(*(keys.rule_state_chunk(job_id, i) for i in range(_chunk_count(int(old_state_size)))))
                    pipe.delete(keys.rule_state_size(job_id))
                if state_blob is not None:
                    queue_state_write(pipe, job_id, state_blob)
                pipe.set(keys.version(job_id), version)
                pipe.set(keys.params_tag(job_id), new_tag())
                pipe.execute()
                return True
            except redis.WatchError:
                continue


def read_blob(r: redis.Redis, job_id: int) -> tuple[int, bytes]:
    """A consistent (version, safetensors blob) of W_s."""
    blobs = read_blobs(r, job_id, with_state=False)
    return blobs.version, blobs.params


def version_of(r: redis.Redis, job_id: int) -> int:
    """W_s's version (one GET); NoServerModel when the job has none."""
    version = r.get(keys.version(job_id))
    if version is None:
        raise NoServerModel(f"job {job_id} has no server model in Redis")
    return int(version)


def read(r: redis.Redis, job_id: int) -> tuple[int, Params]:
    version, blob = read_blob(r, job_id)
    return version, decode(blob)


def read_state(r: redis.Redis, job_id: int) -> tuple[int, Params | None]:
    """A consistent (version, rule state) of the job; the state is None until a merge created it."""
    blobs = read_blobs(r, job_id, with_state=True)
    return blobs.version, None if blobs.state is None else decode(blobs.state)


def read_with_state(r: redis.Redis, job_id: int) -> tuple[int, Params, Params | None]:
    """A consistent (version, W_s, rule state or None) in one read, as read-only views of the bytes."""
    blobs = read_blobs(r, job_id, with_state=True)
    return blobs.version, views(blobs.params), None if blobs.state is None else views(blobs.state)


@dataclass(frozen=True)
class Blobs:
    version: int
    tag: str | None
    params: bytes
    state: bytes | None


def read_blobs(r: redis.Redis, job_id: int, with_state: bool) -> Blobs:
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
    return Blobs(int(version), None if tag is None else keys.text(tag), b"".join(chunks[:n]), state)


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


def new_tag() -> str:
    return secrets.token_hex(8)


def close_merges(r: redis.Redis, job_id: int) -> set[int]:
    """Stop the job's merges for good; returns the assignment ids W_s holds, final from now on."""
    with r.pipeline() as pipe:  # MULTI: the flag and the read of the set are one step
        pipe.set(keys.closed(job_id), 1)
        pipe.smembers(keys.merged(job_id))
        _, merged = pipe.execute()
    return {int(m) for m in merged}


def merges_closed(r: redis.Redis, job_id: int) -> bool:
    return bool(r.exists(keys.closed(job_id)))


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
