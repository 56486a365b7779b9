"""Each running job's in-flight counts for the work request's budget (crowdtrain.server.services.backpressure):
its assignments dispatched or uploaded but not merged, and the hosts holding them, kept per process.

Counting them is a range scan over every unmerged assignment of the job; done on each work request,
its cost grew with the work out (at 10,000 hosts, PostgreSQL spent 2.4 ms a request with about
2,000 in flight and 3.9 ms with 9,000). So a process counts a job again only when its counts are
older than MAX_AGE_S or W_s has moved since (a merge is what makes room), in one statement for every
job that needs it, and adds its own claims meanwhile. What it does not see until then are other
processes' claims and assignments ended otherwise than merged (timed out, given back, refused): the
budget may be passed by what the other processes claim within MAX_AGE_S, as requests running at the
same moment already could, and a held host may be held up to MAX_AGE_S longer after a time-out.
"""

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from sqlalchemy import Connection, bindparam, func, select

from crowdtrain.server.ledger.models import Assignment
from crowdtrain.server.services.backpressure import UNMERGED
from crowdtrain.server.services.job_terms import JobKey, LiveJob, job_key

MAX_AGE_S = 1.0
FORGET_AFTER_S = 60.0  # counts no request has asked for this long are dropped (jobs that ended)

_COUNTS = (
    select(Assignment.job_id, func.count(), func.count(func.distinct(Assignment.host_id)))
    .where(Assignment.job_id.in_(bindparam("ids", expanding=True)), Assignment.status.in_(UNMERGED))
    .group_by(Assignment.job_id)
)


@dataclass
class _Counted:
    param_version: int  # W_s's version the counts were taken at
    at: float  # time.monotonic() when
    in_flight: int
    hosts: int


class InFlightCounts:
    """One process's counts of its running jobs' work in flight (the module's docstring says how fresh),
    each job known by its `job_key`, as the job terms' cache knows it."""

    def __init__(self, max_age: float = MAX_AGE_S) -> None:
        self.max_age = max_age
        self._counted: dict[JobKey, _Counted] = {}
        self._lock = threading.Lock()

    def of(self, c: Connection, live: Mapping[int, LiveJob], now: float | None = None) -> dict[int, LiveJob]:
        """`live` with each job's `in_flight` and `in_flight_hosts` filled in, counted on `c` for the jobs
        whose counts are stale at `now` (time.monotonic() by default)."""
        now = time.monotonic() if now is None else now
        keys = {j: job_key(c, j, job.created_at) for j, job in live.items()}
        with self._lock:
            known = {j: self._counted.get(key) for j, key in keys.items()}
        counts = {j: k for j, k in known.items() if k is not None and self._fresh(k, live[j].param_version, now)}
        if stale := [j for j in live if j not in counts]:
            rows = {row[0]: (row[1], row[2]) for row in c.execute(_COUNTS, {"ids": stale})}
            counts |= {j: _Counted(live[j].param_version, now, *rows.get(j, (0, 0))) for j in stale}
            with self._lock:
                self._counted.update({keys[j]: counts[j] for j in stale})
                # Jobs that no longer run (or other databases'): nothing asked for them for a while.
                self._counted = {key: k for key, k in self._counted.items() if now - k.at < FORGET_AFTER_S}
        return {
            j: replace(job, in_flight=counts[j].in_flight, in_flight_hosts=counts[j].hosts) for j, job in live.items()
        }

    def claimed(self, c: Connection, job: LiveJob, count: int) -> None:
        """This process gave `count` of `job`'s workunits to the host `job` was read for (which held
        none of its work when `job.held_by_host` is 0): counted until the job is counted again."""
        with self._lock:
            counted = self._counted.get(job_key(c, job.id, job.created_at))
            if counted is not None and count > 0:
                counted.in_flight += count
                counted.hosts += int(not job.held_by_host)

    def _fresh(self, counted: _Counted, param_version: int, now: float) -> bool:
        return counted.param_version == param_version and 0 <= now - counted.at < self.max_age
