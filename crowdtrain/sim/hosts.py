"""The simulated hosts of the training simulator (crowdtrain.sim.training): how many there are, their
task slots, speeds and network, how they are preempted, and the wall time that model predicts.

Timing model. Host i has a speed factor s_i ~ lognormal(0, speed_sigma), seeded, the factors
scaled to mean 1 (so one host has speed 1, whatever the seed). An assignment takes a transfer for
the snapshot, one for the shard unless the host has it cached, the compute time (`workunit_seconds`,
or else `example_seconds` x shard examples x local_epochs) times the assignment's local fraction
(1 unless `training.dynamic_local_work`) divided by s_i, and a transfer for the upload; each
transfer takes `network_seconds`. With `jitter_sigma` > 0 each assignment's compute time is also
multiplied by its own draw from lognormal(-jitter_sigma^2/2, jitter_sigma) (mean 1): a real slot's
passes differ from one workunit to the next, and the order in which a host's slots finish, which
decides the order of merges, follows from that spread. As the client does (client/worker.py), a host holds `slots`
assignments not yet trained, `slots` + 1 with `prefetch`: the extra one downloads while the others
train and waits for a free slot; with `late_snapshot` it trains from the snapshot published when the
slot starts it, not the one published at its dispatch. A host asks for the next assignment as soon as a slot stops
training (the upload overlaps it). Told that there is nothing for it (the job at its in-flight budget, or
between epochs), it asks again `retry_after` seconds later (the scheduler's work_retry_after), or at once
when one of its own slots frees, as the client does; with retry_after 0 it is given work the moment
some is ready.
With `keep_optimizer_state` a slot keeps its optimizer's state (Adam moments and step, SGD
momentum) from one workunit to the next, the next starting from a newer snapshot of W_s (see
crowdtrain.sim.training); by default each workunit's optimizer starts from zero, as the client's.
Merges take time in the parameter servers' queue (crowdtrain.sim.servers).

Preemption: each assignment is preempted with probability `p`, drawn at dispatch. It vanishes
without a result; the scheduler notices at its deadline (`timeout` t_o after dispatch) and the
workunit is ready again (or failed after max_errors). Its place on the host (with prefetch, one of
the slots + 1) comes back `restart_seconds` after dispatch; by default t_o, the VC-ASGD paper's
model, in which a slot loses t_o per preemption. A result that arrives after its deadline is refused, as the scheduler
refuses the upload of a timed-out assignment.

Wall-time model of the VC-ASGD paper (Atre et al.; DESIGN.md section 4): with n rounds of work per
slot, task time t_e, timeout t_o and preemption probability p, a run takes about n*t_e + n*p*t_o
(`paper_wall_time`), without prefetch and with instant merges. We read n as the workunits done per
slot: n = epochs x shards / (hosts x slots), work spread evenly; t_e is one workunit's time on a
slot, transfers included. The formula counts one timeout per workunit preempted; with independent
preemptions a re-run may be preempted again, and the exact expectation in this model is n*t_e +
n*p/(1-p)*t_o (`expected_wall_time`): for p = 0.2 that is 4.8% above the paper's figure when t_o =
1.2 t_e and 9.4% when t_o = 3 t_e. Epoch boundaries add idle time when an epoch's last workunits
straggle (a few % at p = 0.2 with 4 workunits per slot and epoch).
tests/crowdtrain/sim/test_training.py measures both.
"""

from dataclasses import dataclass

import numpy as np

from crowdtrain.core.settings import Settings


def paper_wall_time(n: float, t_e: float, p: float, t_o: float) -> float:
    """The VC-ASGD paper's wall time n*t_e + n*p*t_o (n workunits per slot)."""
    return n * t_e + n * p * t_o


def expected_wall_time(n: float, t_e: float, p: float, t_o: float) -> float:
    """The expectation in this simulator's model, re-runs preempted again included: n*t_e + n*p/(1-p)*t_o."""
    return n * t_e + n * p / (1 - p) * t_o


# The scheduler's answer to a host it gives nothing: ask again after this many seconds (Settings.work_retry_after).
WORK_RETRY_AFTER: float = Settings.model_fields["work_retry_after"].default


@dataclass(frozen=True)
class Fleet:
    """The simulated hosts and their network; see the module docstring for the timing model."""

    hosts: int = 8
    slots: int = 1
    p: float = 0.0
    timeout: float | None = None  # t_o; None: the spec's scheduling.deadline_seconds
    network_seconds: float = 0.0
    speed_sigma: float = 0.5
    example_seconds: float = 1e-3
    workunit_seconds: float | None = None
    restart_seconds: float | None = None  # None: t_o
    prefetch: bool = True  # the client's: slots + 1 assignments held, the next downloaded while one trains
    keep_optimizer_state: bool = False  # a slot's next workunit starts from its optimizer state, not zero
    jitter_sigma: float = 0.0  # spread of one assignment's compute time around its host's (log scale)
    late_snapshot: bool = False  # a slot trains from the newest snapshot when it starts, not the dispatched one
    retry_after: float = WORK_RETRY_AFTER  # a host given nothing waits this long (or until a slot frees); 0: next event

    def __post_init__(self) -> None:
        for name in ("hosts", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.p < 1:
            raise ValueError(f"p (preemption probability) must lie in [0, 1), got {self.p}")
        for name in (
            "timeout",
            "network_seconds",
            "speed_sigma",
            "example_seconds",
            "workunit_seconds",
            "restart_seconds",
            "jitter_sigma",
            "retry_after",
        ):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.timeout == 0:
            raise ValueError("timeout must be > 0")

    def speeds(self, rng: np.random.Generator) -> np.ndarray:
        """Each host's speed factor s_i, drawn from `rng`."""
        # Scaled to mean 1: N hosts have N times the throughput of one speed-1 host, whatever the draw,
        # so a speedup over one slot measures the protocol, not the luck of the draw.
        speeds = rng.lognormal(0.0, self.speed_sigma, self.hosts)
        return speeds / speeds.mean()

    def jitter(self, rng: np.random.Generator) -> float:
        """One assignment's compute-time factor (mean 1), drawn from `rng`; 1 without a draw when
        jitter_sigma is 0, so runs without jitter draw the same numbers as before it existed."""
        if not self.jitter_sigma:
            return 1.0
        return float(rng.lognormal(-(self.jitter_sigma**2) / 2, self.jitter_sigma))

    def preempts(self, rng: np.random.Generator) -> bool:
        """Whether an assignment is preempted, drawn at its dispatch (nothing is drawn when p is 0)."""
        return bool(self.p) and rng.random() < self.p

    def work_seconds(self, examples: int, local_epochs: int) -> float:
        """A workunit's compute time on a speed-1 host at local fraction 1: `workunit_seconds`, or else
        `example_seconds` x its examples x local_epochs."""
        return (
            self.workunit_seconds
            if self.workunit_seconds is not None
            else self.example_seconds * examples * local_epochs
        )
