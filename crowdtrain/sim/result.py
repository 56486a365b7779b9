"""What a simulated training run did (crowdtrain.sim.training.simulate_training's answer): its
figures, its trace of dispatches, its JSON form and its table on the terminal."""

import statistics
from dataclasses import asdict, dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table

from crowdtrain.sim.hosts import Fleet
from crowdtrain.sim.records import Metric
from crowdtrain.sim.servers import ParameterServers


@dataclass(frozen=True)
class Dispatch:
    """One assignment handed out (the run's trace)."""

    time: float
    assignment: int
    workunit: int
    epoch: int
    shard: int
    host: int
    preempted: bool
    local_fraction: float = 1.0
    in_flight: int = 0  # the job's unmerged assignments just after this dispatch, this one included


@dataclass
class SimResult:
    """What a simulated run did; `summary()` is its JSON form."""

    name: str
    rule: str
    fleet: Fleet
    seed: int
    compute: bool
    outcome: str
    message: str
    epochs: int
    merges: int
    dispatched: int
    preemptions: int
    timeouts: int
    late_results: int
    refusals: dict[str, int]
    failed_workunits: int
    examples: int  # examples trained into merged results
    uploads: int  # results that reached the scheduler (merged, refused or late)
    upload: str  # the encoding (crowdtrain.core.updates.upload_label)
    upload_bytes: int  # bytes per upload (the mean of those that reached the scheduler)
    bytes_uploaded: int  # in all
    sim_seconds: float  # simulated wall time until the job ended
    real_seconds: float  # time the simulation took
    final_accuracy: float | None
    staleness: list[int] = field(repr=False)
    metrics: list[Metric] = field(repr=False)
    epoch_figures: dict[int, float | None] = field(repr=False)
    trace: list[Dispatch] = field(repr=False)
    merged_hosts: list[int] = field(repr=False, default_factory=list)  # the host of each merge
    host_speeds: list[float] = field(repr=False, default_factory=list)  # s_i of each host
    servers: ParameterServers = field(default_factory=ParameterServers)
    merged: list[int] = field(repr=False, default_factory=list)  # the assignment of each merge, in order
    arrivals: list[int] = field(repr=False, default_factory=list)  # assignments whose results came, in order
    # assignment id -> when its place on its host was free again (training ended, or a preempted one restarted)
    place_freed: dict[int, float] = field(repr=False, default_factory=dict)
    merge_waits: list[float] = field(repr=False, default_factory=list)  # arrival -> merge start, per result
    longest_backlog: int = 0  # the most results ever waiting while a pass ran
    passes: list[int] = field(repr=False, default_factory=list)  # the results of each merge pass, in order

    def held(self, host: int, at: float) -> int:
        """Assignments `host` held at `at` (dispatched by then, their place not yet free): what
        the client counts against `slots` (+1 with prefetch) when it asks for work."""
        return sum(
            1
            for d in self.trace
            if d.host == host and d.time <= at and self.place_freed.get(d.assignment, float("inf")) > at
        )

    def staleness_by_host(self) -> dict[int, float]:
        """Each host's mean staleness over its merged results."""
        per: dict[int, list[int]] = {}
        for host, s in zip(self.merged_hosts, self.staleness, strict=True):
            per.setdefault(host, []).append(s)
        return {h: statistics.fmean(v) for h, v in sorted(per.items())}

    @property
    def best_accuracy(self) -> float | None:
        return max((m.accuracy for m in self.metrics), default=None)

    def first_reaching(self, target: float) -> Metric | None:
        """The first validation of W_s at or above `target` (its examples and simulated time)."""
        return next((m for m in self.metrics if m.accuracy >= target), None)

    def staleness_summary(self) -> dict:
        if not self.staleness:
            return {"mean": None, "p50": None, "p90": None, "max": None}
        s = np.asarray(self.staleness)
        return {
            "mean": round(float(s.mean()), 2),
            "p50": float(np.percentile(s, 50)),
            "p90": float(np.percentile(s, 90)),
            "max": int(s.max()),
        }

    def summary(self, curve_points: int = 20) -> dict:
        """JSON-able figures; the accuracy curve thinned to about `curve_points` points."""
        step = max(1, len(self.metrics) // max(curve_points, 1))
        curve = self.metrics[step - 1 :: step]
        if self.metrics and (not curve or curve[-1] is not self.metrics[-1]):
            curve.append(self.metrics[-1])
        return {
            "name": self.name,
            "rule": self.rule,
            **asdict(self.fleet),
            "seed": self.seed,
            "compute": self.compute,
            "outcome": self.outcome,
            "message": self.message,
            "epochs": self.epochs,
            "merges": self.merges,
            "dispatched": self.dispatched,
            "preemptions": self.preemptions,
            "timeouts": self.timeouts,
            "late_results": self.late_results,
            "refusals": self.refusals,
            "failed_workunits": self.failed_workunits,
            "examples": self.examples,
            "uploads": self.uploads,
            "upload": self.upload,
            "upload_bytes": self.upload_bytes,
            "bytes_uploaded_per_merge": round(self.bytes_uploaded / self.merges) if self.merges else None,
            "mean_local_fraction": round(statistics.fmean(d.local_fraction for d in self.trace), 4)
            if self.trace
            else None,
            "sim_seconds": round(self.sim_seconds, 3),
            "real_seconds": round(self.real_seconds, 2),
            "final_accuracy": self.final_accuracy,
            "best_accuracy": self.best_accuracy,
            "staleness": self.staleness_summary(),
            **{f"parameter_server_{k}": v for k, v in asdict(self.servers).items()},
            "merge_wait_mean_s": round(statistics.fmean(self.merge_waits), 4) if self.merge_waits else None,
            "merge_wait_max_s": round(max(self.merge_waits), 4) if self.merge_waits else None,
            "longest_backlog": self.longest_backlog,
            "mean_pass": round(statistics.fmean(self.passes), 2) if self.passes else None,
            "epoch_accuracy": {str(e): f for e, f in self.epoch_figures.items() if f is not None},
            "curve": [
                {
                    "merges": m.version,
                    "examples": m.examples,
                    "sim_seconds": round(m.time, 3),
                    "accuracy": round(m.accuracy, 4),
                }
                for m in curve
            ],
        }


def print_table(result: SimResult) -> None:
    """The run's main figures as a rich table on the terminal."""
    s = result.summary()
    table = Table(
        title=f"{result.name}: {result.fleet.hosts} hosts x {result.fleet.slots} slots, "
        f"rule {result.rule}, p={result.fleet.p}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in (
        "outcome",
        "epochs",
        "merges",
        "examples",
        "sim_seconds",
        "real_seconds",
        "final_accuracy",
        "best_accuracy",
        "dispatched",
        "preemptions",
        "timeouts",
        "late_results",
        "failed_workunits",
        "upload",
        "upload_bytes",
        "mean_local_fraction",
    ):
        table.add_row(key, str(s[key]))
    table.add_row("refusals", ", ".join(f"{k}: {v}" for k, v in s["refusals"].items()) or "0")
    table.add_row("staleness", " ".join(f"{k} {v}" for k, v in s["staleness"].items()))
    Console().print(table)
