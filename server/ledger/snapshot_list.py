"""Which published snapshots of W_s a job keeps in object storage: a Redis list of their versions,
newest first (`keys.snapshots`). Only the newest few are kept, and none that an unmerged assignment
started from (crowdtrain.assimilator.merge decides; this module only keeps the list)."""

import redis

from crowdtrain.core import keys


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
