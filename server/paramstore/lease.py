"""A job's merge lease: one process merges a job's results at a time, and no merge is left behind.

A process that has a result of a job to merge asks for the job's merges (`keys.merges_wanted`),
then tries the lease without waiting. The one that gets it merges everything the job has ready,
pass after pass, while anyone asks again; the others return at once, their results left to it.
The holder looks for a request once more after it lets the lease go, and takes the lease again
when it finds one, so no request is lost between its last look and its release: a request made
while it held the lease either came before its last look (that pass saw the result: it was
stored before it was asked for) or is found after the release.

Correctness of W_s does not rest on the lease: the merge transaction
(crowdtrain.server.paramstore.merging.merge_batch) is exactly-once either way, so a lease that
lapses (its holder stalled or died) only lets two processes merge for a while, and the results a
dead holder left are taken by the next process asked to merge the job's results (or queued again
by the transitioner's sweep of stalled merges).
"""

from collections.abc import Callable
from contextlib import suppress

import redis
from redis.exceptions import LockNotOwnedError

from crowdtrain.core import keys

MERGE_LEASE_SECONDS = 30.0  # a holder that dies or stalls loses its job's merge lease after this long

# Run by the holder with a callable that renews its lease: the job's ready results, merged.
Drain = Callable[[Callable[[], object]], None]


def serve(r: redis.Redis, job_id: int, drain: Drain) -> bool:
    """Ask for the job's merges and run `drain` as the job's only merging process, again while merges
    were asked for meanwhile; or return False at once when another process holds the lease (it
    will run them). True when this process ran `drain`. `drain` renews the lease between passes."""
    wanted = keys.merges_wanted(job_id)
    r.set(wanted, 1)
    served = False
    while True:  # the request just made stands: the lease is tried at once, with no look at it first
        lease = r.lock(keys.merge_lease(job_id), timeout=MERGE_LEASE_SECONDS)
        if not lease.acquire(blocking=False):
            return served
        try:
            while r.delete(wanted):
                served = True
                drain(lease.reacquire)
        finally:
            with suppress(LockNotOwnedError):  # it lapsed while a pass ran; another may hold it now
                lease.release()
        if not r.exists(wanted):
            return served
