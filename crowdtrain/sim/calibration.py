"""The simulator's timing, measured on a real job: what crowdtrain.sim needs to replay that job's run.

A real job leaves, per merged or ended assignment, when it was sent and uploaded, its examples and
the seconds its host reports training (table `assignments`); per pass of its merges, which results
W_s took and when it was written (the Redis merge log, keys.merge_log: one `merged_at` per pass);
and when each metric was recorded (table `metrics`). From them, `measure` gives:

- `example_seconds`: the median seconds per training example of one slot, and `speed_sigma`: the
  spread (standard deviation of the logarithm) of the hosts' mean seconds per example, and
  `jitter_sigma`: the spread of one assignment's seconds per example around its host's mean (the
  pooled standard deviation of the logarithm within hosts);
- `network_seconds`: one transfer, half the 10th percentile of an assignment's time from its
  dispatch to its upload beyond its training (a download and an upload, nothing waited for);
- `eval_seconds`: the median time from a pass's write of W_s to the metric recorded after it;
- `pass_seconds` and `merge_seconds`: a least-squares fit of the time between two passes' writes,
  `pass_seconds + merge_seconds x (results in the later pass)` (+ the evaluation after the earlier
  one, when it had one), over passes that started with a backlog (the later pass's first result
  had arrived before the earlier pass wrote), so that the time measures service, not waiting. With
  fewer than `MIN_BACKLOGGED` such passes, the merges never queued and their time hardly matters:
  the simulator's defaults stand (`fitted` says which).

benchmarks/sim_agreement.py replays real jobs with it; tests/test_sim_agreement_end_to_end.py checks
the replay on a small one.
"""

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import redis
from sqlalchemy import select

from crowdtrain.core import keys
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Metric
from crowdtrain.sim.servers import MERGE_SECONDS, PASS_SECONDS

MIN_BACKLOGGED = 5  # passes that started with a backlog, to fit a pass's service time


@dataclass(frozen=True)
class Timing:
    """The simulator's timing parameters measured on one real job (see the module docstring)."""

    example_seconds: float
    speed_sigma: float
    jitter_sigma: float
    network_seconds: float
    eval_seconds: float
    pass_seconds: float
    merge_seconds: float
    passes: int  # the job's merge passes
    mean_pass: float  # results per pass
    backlogged: int  # passes that started with a backlog (the fit's rows)
    fitted: bool  # whether pass_seconds and merge_seconds were fitted (else the simulator's defaults)

    def sim_settings(self) -> dict:
        """Keyword arguments of crowdtrain.sim.training.simulate_training."""
        return {
            k: getattr(self, k)
            for k in (
                "example_seconds",
                "speed_sigma",
                "jitter_sigma",
                "network_seconds",
                "eval_seconds",
                "pass_seconds",
                "merge_seconds",
            )
        }

    def figures(self) -> dict:
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _epoch(t: datetime) -> float:
    """A database timestamp (naive UTC, as the ledger stores it) as seconds since the epoch."""
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def measure(db_url: str, redis_url: str, job_id: int) -> Timing:
    """The timing of job `job_id` (see the module docstring); ValueError when it merged nothing."""
    db = session_factory(db_url)
    try:
        with db.begin() as s:
            rows = s.execute(
                select(
                    Assignment.host_id,
                    Assignment.sent_at,
                    Assignment.uploaded_at,
                    Assignment.examples,
                    Assignment.train_seconds,
                ).where(Assignment.job_id == job_id, Assignment.uploaded_at.is_not(None))
            ).all()
            metrics = s.execute(select(Metric.param_version, Metric.created_at).where(Metric.job_id == job_id)).all()
    finally:
        db.kw["bind"].dispose()
    r = redis.Redis.from_url(redis_url)
    try:
        log = [json.loads(v) for v in r.hvals(keys.merge_log(job_id))]
    finally:
        r.close()
    trained = [row for row in rows if row.examples and row.train_seconds]
    if not trained or not log:
        raise ValueError(f"job {job_id} has no trained and merged results to measure")
    per_example = [row.train_seconds / row.examples for row in trained]
    by_host: dict[int, list[float]] = {}
    for row, rate in zip(trained, per_example, strict=True):
        by_host.setdefault(row.host_id, []).append(rate)
    speed_sigma, jitter_sigma = _spreads(list(by_host.values()))
    beyond = [_epoch(row.uploaded_at) - _epoch(row.sent_at) - row.train_seconds for row in trained]
    passes = _passes(log)
    eval_seconds = _eval_seconds(passes, metrics)
    evaluated = {m.param_version for m in metrics}
    pass_seconds, merge_seconds, backlogged = _fit_passes(passes, eval_seconds, evaluated)
    return Timing(
        example_seconds=statistics.median(per_example),
        speed_sigma=speed_sigma,
        jitter_sigma=jitter_sigma,
        network_seconds=max(0.0, float(np.percentile(beyond, 10)) / 2),
        eval_seconds=eval_seconds,
        pass_seconds=PASS_SECONDS if pass_seconds is None else pass_seconds,
        merge_seconds=MERGE_SECONDS if merge_seconds is None else merge_seconds,
        passes=len(passes),
        mean_pass=statistics.fmean(len(p.versions) for p in passes),
        backlogged=backlogged,
        fitted=pass_seconds is not None,
    )


def _spreads(rates_by_host: list[list[float]]) -> tuple[float, float]:
    """(speed_sigma, jitter_sigma) of the seconds per example of each host's assignments: the
    standard deviation of the hosts' mean logarithms, and the pooled standard deviation of the
    logarithms around their host's mean (0.0 where there are too few to measure)."""
    logs = [[math.log(r) for r in rates] for rates in rates_by_host if rates]
    means = [statistics.fmean(v) for v in logs]
    within = [x - m for v, m in zip(logs, means, strict=True) for x in v]
    dof = len(within) - len(logs)
    return (
        statistics.stdev(means) if len(means) > 1 else 0.0,
        math.sqrt(sum(x * x for x in within) / dof) if dof > 0 else 0.0,
    )


@dataclass(frozen=True)
class _Pass:
    written_at: float
    versions: list[int]  # W_s's versions after each of its results
    first_received: float | None  # the earliest of its results' arrivals at the scheduler


def _passes(log: list[dict]) -> list[_Pass]:
    """The merge log's entries grouped by pass (one `merged_at` per pass), in order."""
    groups: dict[float, list[dict]] = {}
    for entry in log:
        if entry.get("merged_at") is not None:
            groups.setdefault(entry["merged_at"], []).append(entry)
    out = []
    for written_at in sorted(groups):
        entries = groups[written_at]
        received = [e["received_at"] for e in entries if e.get("received_at") is not None]
        out.append(_Pass(written_at, sorted(e["version"] for e in entries), min(received, default=None)))
    return out


def _eval_seconds(passes: list[_Pass], metrics: Sequence[Any]) -> float:
    """The median time from a pass's write to the metric recorded for its last version."""
    written = {p.versions[-1]: p.written_at for p in passes}
    spans = [_epoch(m.created_at) - written[m.param_version] for m in metrics if m.param_version in written]
    spans = [s for s in spans if s >= 0]
    return statistics.median(spans) if spans else 0.0


def _fit_passes(
    passes: list[_Pass], eval_seconds: float, evaluated: set[int]
) -> tuple[float | None, float | None, int]:
    """pass_seconds and merge_seconds fitted over the passes that started with a backlog (None, None
    when fewer than MIN_BACKLOGGED did), and how many did. The evaluation after a pass whose last
    version has a metric (`evaluated`) is taken off the gap that follows it, as its median length."""
    sizes, gaps = [], []
    for before, after in zip(passes, passes[1:], strict=False):
        if after.first_received is None or after.first_received >= before.written_at:
            continue  # the later pass waited for its first result: its gap is not service time
        sizes.append(float(len(after.versions)))
        gaps.append(after.written_at - before.written_at - (eval_seconds if before.versions[-1] in evaluated else 0.0))
    if len(sizes) < MIN_BACKLOGGED:
        return None, None, len(sizes)
    k, g = np.array(sizes), np.maximum(np.array(gaps), 0.0)
    (fixed, each), *_ = np.linalg.lstsq(np.stack([np.ones_like(k), k], axis=1), g, rcond=None)
    if each < 0:  # a pass's time does not grow with its size here: all of it is the pass's own
        fixed, each = float(np.median(g)), 0.0
    elif fixed < 0:  # nor has it a cost of its own: all of it is its results'
        fixed, each = 0.0, float(g.sum() / k.sum())
    return float(fixed), float(each), len(sizes)
