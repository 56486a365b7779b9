"""W_s in Redis: initialise, read, and merge exactly once per assignment.

A merge is an optimistic transaction: WATCH the version and the merged-set, compute, then
MULTI/EXEC the new parameters, the new version and the assignment id together. Two parameter
servers racing on one job retry; a redelivered task finds its id in the merged-set and does
nothing. So every assignment is merged exactly once, however often its task runs.
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from crowdtrain import keys
from crowdtrain.tensors import Params, decode, encode


class NoServerModel(RuntimeError):
    """Redis holds no W_s for the job (never initialised, or Redis lost its data)."""


@dataclass(frozen=True)
class MergeOutcome:
    version: int  # version of W_s that includes this assignment
    applied_now: bool  # False when an earlier delivery already merged it


# One worker process serves merges one at a time; keeping the W_s it last wrote saves a GET.
_cache: dict[int, tuple[int, Params]] = {}


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=60, health_check_interval=30)


def initialise(r: redis.Redis, job_id: int, params: Params, version: int = 0) -> None:
    """Set W_s and its version; does nothing if the job already has a server model."""
    blob = encode(params)
    with r.pipeline() as pipe:
        pipe.set(keys.params(job_id), blob, nx=True)
        pipe.set(keys.version(job_id), version, nx=True)
        pipe.execute()


def read(r: redis.Redis, job_id: int) -> tuple[int, Params]:
    with r.pipeline() as pipe:
        pipe.get(keys.version(job_id))
        pipe.get(keys.params(job_id))
        version, blob = pipe.execute()
    if version is None or blob is None:
        raise NoServerModel(f"job {job_id} has no server model in Redis")
    return int(version), decode(blob)


def read_blob(r: redis.Redis, job_id: int) -> tuple[int, bytes]:
    with r.pipeline() as pipe:
        pipe.get(keys.version(job_id))
        pipe.get(keys.params(job_id))
        version, blob = pipe.execute()
    if version is None or blob is None:
        raise NoServerModel(f"job {job_id} has no server model in Redis")
    return int(version), blob


def merged_version(r: redis.Redis, job_id: int, assignment_id: int) -> int | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else int(json.loads(raw)["version"])


def merge_once(r: redis.Redis, job_id: int, assignment_id: int,
               merge: Callable[[Params, int], Params], received_at: float | None = None) -> MergeOutcome:
    """Apply `merge(W_s, version) -> new W_s` exactly once for `assignment_id`.

    `merge` may update W_s in place and may raise to refuse the result; either way nothing is
    written unless the whole transaction commits.
    """
    vkey, pkey, mkey, lkey = (keys.version(job_id), keys.params(job_id), keys.merged(job_id),
                              keys.merge_log(job_id))
    member = str(assignment_id)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(vkey, mkey)
                if pipe.sismember(mkey, member):
                    pipe.unwatch()
                    return MergeOutcome(merged_version(r, job_id, assignment_id) or 0, applied_now=False)
                raw_version = pipe.get(vkey)
                if raw_version is None:
                    raise NoServerModel(f"job {job_id} has no server model in Redis")
                version = int(raw_version)
                cached = _cache.pop(job_id, None)
                params = cached[1] if cached and cached[0] == version else decode(pipe.get(pkey))
                new = merge(params, version)
                entry = json.dumps({"version": version + 1, "merged_at": time.time(), "received_at": received_at})
                pipe.multi()
                pipe.set(pkey, encode(new))
                pipe.set(vkey, version + 1)
                pipe.sadd(mkey, member)
                pipe.hset(lkey, member, entry)
                pipe.execute()
                _cache[job_id] = (version + 1, new)
                return MergeOutcome(version + 1, applied_now=True)
            except redis.WatchError:
                continue
