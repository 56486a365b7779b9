"""The hosts waiting on in-flight budgets: each host that a work request left with nothing because jobs
were at their budget is noted in Redis with the time (one sorted set, shared by every scheduler
process), and those noted within the last `window` seconds (the longest a held host waits before it
asks again, work_retry_after) are the hosts waiting now. Their number sets how long each is told to
wait (crowdtrain.server.services.backpressure.held_seconds): with many idle hosts held by few jobs,
their requests together should come about as often as merges make room, not each host as often as
one merge. One Redis round trip per held request; nothing for a request that is given work."""

import redis

from crowdtrain.core import keys


def note_waiting(r: redis.Redis, host_id: int, now: float, window: float) -> int:
    """Note `host_id` held back at `now`; the hosts held within the last `window` seconds, it included."""
    with r.pipeline(transaction=True) as p:
        p.zadd(keys.HELD_HOSTS, {str(host_id): now})
        p.zremrangebyscore(keys.HELD_HOSTS, "-inf", f"({now - window}")
        p.zcard(keys.HELD_HOSTS)
        return int(p.execute()[-1])
