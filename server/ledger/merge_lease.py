"""A job's merge lease: parameter servers merging the same job take turns instead of computing merges
whose transaction would lose to another's write and send W_s for nothing. Correctness does not rest
on it: the merge transaction (crowdtrain.server.ledger.paramstore.merge_once) is exactly-once either
way, so a lease that lapses only costs a retry."""

from collections.abc import Iterator
from contextlib import contextmanager, suppress

import redis
from redis.exceptions import LockNotOwnedError

from crowdtrain.core import keys

MERGE_LEASE_SECONDS = 30.0  # a holder that dies or stalls loses its job's merge lease after this long
LEASE_POLL_SECONDS = 0.002


@contextmanager
def held(r: redis.Redis, job_id: int) -> Iterator[None]:
    """Hold the job's merge lease while the body runs, or run it without once MERGE_LEASE_SECONDS have
    passed waiting (a holder that stalled)."""
    lease = r.lock(
        keys.merge_lease(job_id),
        timeout=MERGE_LEASE_SECONDS,
        sleep=LEASE_POLL_SECONDS,
        blocking_timeout=MERGE_LEASE_SECONDS,
    )
    acquired = lease.acquire()
    try:
        yield
    finally:
        if acquired:
            with suppress(LockNotOwnedError):  # it lapsed while this merge ran; another may hold it now
                lease.release()
