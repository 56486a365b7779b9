"""The parameter servers of the training simulator (crowdtrain.sim.training): one job's queue of
uploaded results and the processes that serve it, on a simulated clock.

As in the real system, each upload becomes one parameter-server task, queued in order of arrival
(crowdtrain.assimilator.worker.tasks: one Celery task per upload), and the job's `processes`
worker processes take the oldest one whenever they are free. A task's merge takes
`merge_seconds`, and the job's merges take turns (crowdtrain.server.paramstore.lease), granted
in the order the results were taken, so W_s takes them in their order of arrival, each once. A
merge that makes W_s's version a multiple of `eval_every` is then evaluated for `eval_seconds`
by the same process, outside the lease (crowdtrain.assimilator.merge._record: the metric, then
the snapshot, which dispatch hands out only from then on). So when results come faster than one
merge (and evaluation) each, a backlog forms and every result in it waits, its staleness growing
with the merges ahead of it. A queued result's workunit is still open, so where the epoch-release
window binds (crowdtrain.sim.training) the backlog counts against it and staleness stays within
it, whatever the service times.

Default service times, measured on the real system with mnist1d-cnn's model and scheduling
(examples/mnist1d-cnn.yaml: 10.8k parameters, 1,000 validation examples, a metric and a snapshot
after every merge): one parameter-server process on the 2-core development machine drained 60
queued uploads (benchmarks/merge_latency.py's throughput run, with that model and validation set)
at 28.5 merges/s with neither evaluation nor snapshot, and at 5.0 merges/s with both after every
merge: `merge_seconds` = 1/28.5 = 0.035 s and `eval_seconds` = 1/5.0 - 0.035 = 0.165 s, the
snapshot's publication included (it follows every evaluation in that job). The machine was shared
and the figures vary: an earlier drain, on random data, gave 12 ms per merge, and the same
evaluation timed in one process took 0.02 s on one PyTorch thread and 0.14 s on two. A larger
model or validation set takes longer.

Simplification: all of `merge_seconds` is held under the lease, so more processes overlap only
evaluations with merges; in the real system a task's bookkeeping outside the transaction
(database rows, the upload's read) overlaps too. No I/O.
"""

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from crowdtrain.sim.job import Assignment

MERGE_SECONDS = 0.035
EVAL_SECONDS = 0.165


@dataclass(frozen=True)
class ParameterServers:
    """A job's parameter-server processes and their service times (see the module docstring)."""

    processes: int = 1
    merge_seconds: float = MERGE_SECONDS
    eval_seconds: float = EVAL_SECONDS

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ValueError(f"parameter_servers must be at least 1, got {self.processes}")
        for name in ("merge_seconds", "eval_seconds"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(eq=False)
class MergeQueue:
    """One job's uploaded results waiting for a parameter server, first in, first out.

    `waits` holds, for each result taken, the seconds from its arrival to the start of its merge;
    `longest` the most results ever left waiting with every process busy (the backlog). The caller
    calls `take` after every `arrive` and `done`.
    """

    servers: ParameterServers
    waiting: deque[tuple[float, Assignment]] = field(default_factory=deque)  # (arrived at, result)
    waits: list[float] = field(default_factory=list)
    longest: int = 0

    def __post_init__(self) -> None:
        self.free = self.servers.processes
        self.lease_free_at = 0.0  # when the merge taken last leaves the job's merge lease

    def arrive(self, a: Assignment, now: float) -> None:
        self.waiting.append((now, a))

    def take(self, now: float) -> list[tuple[Assignment, float]]:
        """The results free processes take now, oldest first, each with the time its merge ends."""
        taken = []
        while self.free and self.waiting:
            arrived, a = self.waiting.popleft()
            self.free -= 1
            start = max(now, self.lease_free_at)
            self.lease_free_at = start + self.servers.merge_seconds
            self.waits.append(start - arrived)
            taken.append((a, self.lease_free_at))
        self.longest = max(self.longest, len(self.waiting))
        return taken

    def done(self) -> None:
        """A process finished its task (merge, and evaluation when due) and is free again."""
        self.free += 1
