"""The parameter servers of the training simulator (crowdtrain.sim.training): one job's queue of
uploaded results and the passes that merge it, on a simulated clock.

As in the real system (crowdtrain.assimilator.merge_pass), one process at a time holds the job's
merge lease and merges what the job has queued in passes: the oldest results, up to `max_pass`
(MAX_PASS) a pass, into W_s read once and written once. A pass takes `pass_seconds` plus
`merge_seconds` for each result in it (reading the result, the rule's arithmetic, the database
rows); W_s's version moves when the pass writes it. When one of the pass's versions is due for a
metric (`eval_every`), the holder then evaluates W_s once, for `eval_seconds`, still holding the
lease (crowdtrain.assimilator.recording.record_merged: the metric, then the snapshot, which dispatch
hands out only from then on), and the results are done. So another process never makes one job's
merges faster or slower: `processes` serve more jobs, and this simulator runs one. When results
come faster than passes take them, the queue grows, a pass takes more at once, and staleness
grows with the merges ahead of each result. A queued result's workunit is still open, so where the
epoch-release window binds (crowdtrain.sim.training) the backlog counts against it.

Default service times: crowdtrain.sim.calibration fits them to a real run's
merge log (one row per pass: its results and when it wrote W_s) and its metrics; the defaults
are that fit for mnist1d-cnn (examples/mnist1d-cnn.yaml: 10.8k parameters, 1,000 validation
examples) on the 2-core development machine, quoted where they are defined. A larger model or
validation set takes longer; the benchmark measures its own.
"""

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from crowdtrain.assimilator.merge_pass import MAX_PASS
from crowdtrain.sim.records import Assignment

PASS_SECONDS = 0.030  # a pass's own cost: the lease, W_s read and written, the database's transaction
MERGE_SECONDS = 0.010  # each result in a pass: its upload read and checked, the rule, its rows
EVAL_SECONDS = 0.100  # one evaluation of W_s on the validation set, with the snapshot that follows


@dataclass(frozen=True)
class ParameterServers:
    """A job's parameter-server processes and their service times (see the module docstring)."""

    processes: int = 1
    merge_seconds: float = MERGE_SECONDS
    eval_seconds: float = EVAL_SECONDS
    pass_seconds: float = PASS_SECONDS
    max_pass: int = MAX_PASS

    def __post_init__(self) -> None:
        if self.processes < 1:
            raise ValueError(f"parameter_servers must be at least 1, got {self.processes}")
        if self.max_pass < 1:
            raise ValueError(f"max_pass must be at least 1, got {self.max_pass}")
        for name in ("merge_seconds", "eval_seconds", "pass_seconds"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    def pass_time(self, results: int) -> float:
        """Seconds from a pass's start to its write of W_s, for `results` results."""
        return self.pass_seconds + results * self.merge_seconds


@dataclass(eq=False)
class MergeQueue:
    """One job's uploaded results waiting for a pass, first in, first out.

    `waits` holds, for each result taken, the seconds from its arrival to the start of its pass;
    `passes` the size of each pass; `longest` the most results ever left waiting while a pass ran
    (the backlog). The caller calls `take` after every `arrive` and `done`.
    """

    servers: ParameterServers
    waiting: deque[tuple[float, Assignment]] = field(default_factory=deque)  # (arrived at, result)
    waits: list[float] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)
    longest: int = 0
    busy: bool = False  # a pass holds the job's merge lease

    def arrive(self, a: Assignment, now: float) -> None:
        self.waiting.append((now, a))
        if self.busy:
            self.longest = max(self.longest, len(self.waiting))

    def take(self, now: float) -> tuple[list[Assignment], float] | None:
        """The pass that starts now, when the lease is free and results wait: the oldest results, up
        to `max_pass`, and the time the pass writes W_s; None otherwise."""
        if self.busy or not self.waiting:
            return None
        batch: list[Assignment] = []
        while self.waiting and len(batch) < self.servers.max_pass:
            arrived, a = self.waiting.popleft()
            self.waits.append(now - arrived)
            batch.append(a)
        self.busy = True
        self.passes.append(len(batch))
        return batch, now + self.servers.pass_time(len(batch))

    def done(self) -> None:
        """The pass ended (its write, and the evaluation when due): the lease is free again."""
        self.busy = False
