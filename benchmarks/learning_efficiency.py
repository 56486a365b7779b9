"""Learning efficiency: training examples each merge rule needs, against one process.

What it measures
    For each task and merge-rule configuration: the training examples the system needs to first
    reach the task's target validation accuracy, divided by the examples one process needs with
    the same model, initial weights, optimizer, learning rate and batch size (the job spec's
    `training` section), measured in the same run. Also the best accuracy each reaches within its
    budget, the merges, the wall time, the bytes uploaded per merge and, in the simulator, the
    simulated wall-time speedup over one slot. A ratio near 1 means volunteers' examples are worth
    as much as one machine's; with T slots the speedup over one machine is about T / ratio.

How
    Baseline: the clients' PyTorch trainer (client/trainers/pytorch.py) runs the task's budget
    (12 passes, or `--budget-passes`) over the whole training set in one call (one optimizer,
    never reset), and W is evaluated on the validation set with the parameter servers' code
    (assimilator/evaluate.py) every shard's worth of examples, through the trainer's checkpoint hook.
    Real system: one `Cluster` (private redis-server, scheduler on SQLite, transitioner, Celery
    parameter servers) for the whole run; per (task, rule, slots, seed) a job is submitted and
    clients with `--slots-per-client` task slots each are started; the job runs the baseline's
    budget x `--system-budget` in epochs (or stops at its target with `--stop-at-target`).
    Per-merge validation accuracy (table `metrics`) is paired with the examples of the results
    merged so far (`assignments.examples` of merged assignments with `merged_version` <= the
    metric's version). Upload sizes come from the scheduler's "result uploaded (N bytes" log lines.
    Simulator: `crowdtrain.sim.training.simulate_training` (see `simulate` below, the one adapter to
    change when its interface settles); reported "unavailable" while it does not exist.
    Tasks: `mnist1d` (examples/mnist1d-cnn.yaml) and `tabular`, a 5-class nonlinear Gaussian-
    mixture task generated here (`tabular_arrays`) and trained with an MLP.
    Rules: `RULE_CONFIGS`, named assimilation sections; `default` is the assimilation section of
    examples/mnist1d-cnn.yaml, i.e. what the project ships. A configuration the code does not know
    yet (spec refused, or `make_rule` raises) is reported "unsupported", not run.

Run
    .venv/bin/python benchmarks/learning_efficiency.py --quick
    .venv/bin/python benchmarks/learning_efficiency.py [--tasks mnist1d,tabular] [--rules default,delta,...]
        [--slots 1,4,8] [--sim-slots 8,64,256] [--seeds 0,1] [--out results.json]

Progress and a table go to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import itertools
import json
import math
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from sqlalchemy import select

from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.assimilator.rules import make_rule
from crowdtrain.client.trainers import limit_threads, train
from crowdtrain.core.jobspec import JobSpec
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job, Metric
from crowdtrain.workgen.datasets import load_dataset
from crowdtrain.workgen.generator import initial_parameters

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = ROOT / "examples" / "mnist1d-cnn.yaml"
DEFAULT_RULE = "default"
TERMINAL = ("succeeded", "failed", "cancelled")
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

# Named assimilation sections (fields of crowdtrain.core.jobspec.AssimilationSpec). `default` is filled
# in from EXAMPLE_SPEC. Add a configuration here and it is benchmarked; one the code does not
# know yet is reported "unsupported".
RULE_CONFIGS: dict[str, dict] = {
    "default": {},
    "vc-asgd": {"rule": "vc-asgd", "schedule": "constant", "alpha": 0.6},
    "delta": {"rule": "delta", "server_lr": 0.2, "staleness_weight": "constant"},
    "delta-poly": {"rule": "delta", "server_lr": 0.5, "staleness_weight": "polynomial", "staleness_a": 0.5},
    "fedbuff": {"rule": "fedbuff", "buffer_size": 2, "combiner": "mean", "server_lr": 0.5},
    "fedbuff-median": {"rule": "fedbuff", "buffer_size": 3, "combiner": "median", "server_lr": 0.5},
    "delta+nesterov": {"rule": "delta", "outer_optimizer": "nesterov", "server_lr": 0.1, "outer_momentum": 0.5},
    "fedbuff+nesterov": {
        "rule": "fedbuff",
        "buffer_size": 2,
        "outer_optimizer": "nesterov",
        "server_lr": 0.2,
        "outer_momentum": 0.5,
    },
    "delta+delayed-nesterov": {
        "rule": "delta",
        "outer_optimizer": "delayed-nesterov",
        "server_lr": 0.4,
        "outer_momentum": 0.5,
        "nesterov_delay": 4,
    },
    "delta+adam": {
        "rule": "delta",
        "outer_optimizer": "adam",
        "server_lr": 0.01,
        "adam_betas": [0.5, 0.9],
        "staleness_weight": "polynomial",
        "staleness_a": 0.5,
    },
    "delta-bf16": {"rule": "delta", "server_lr": 0.2, "upload": {"send": "delta", "dtype": "bfloat16"}},
    "delta-int8": {"rule": "delta", "server_lr": 0.2, "upload": {"send": "delta", "dtype": "int8"}},
}


def say(msg: str) -> None:
    console.print(msg, highlight=False, markup=False)


# ---------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Task:
    name: str
    spec: dict  # a job spec (JSON form) whose assimilation section the rule configuration replaces
    target: float
    budget_passes: int  # the baseline's passes over the training set


def tabular_arrays(
    seed: int = 0,
    n_train: int = 4000,
    n_val: int = 1000,
    classes: int = 5,
    features: int = 24,
    latent: int = 8,
    clusters: int = 8,
    spread: float = 2.5,
    noise: float = 0.2,
) -> dict:
    """A 5-class tabular task, deterministic in `seed`: each class is a mixture of `clusters`
    Gaussians in a `latent`-dimensional space, seen through a random linear map followed by sin
    (even features) or tanh (odd features), plus noise. One MLP process reaches about 0.91."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, spread, size=(classes, clusters, latent))
    mixing = rng.normal(size=(latent, features)) / np.sqrt(latent)
    freq = rng.uniform(0.5, 1.5, size=features)
    even = np.arange(features) % 2 == 0

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, classes, n)
        h = (means[y, rng.integers(0, clusters, n)] + rng.normal(size=(n, latent))) @ mixing
        x = 2.0 * np.where(even, np.sin(freq * h), np.tanh(h)) + noise * rng.normal(size=(n, features))
        return x.astype(np.float32), y.astype(np.int64)

    x, y = draw(n_train)
    x_val, y_val = draw(n_val)
    return {"x": x, "y": y, "x_val": x_val, "y_val": y_val}


def example_spec() -> dict:
    return JobSpec.model_validate(yaml.safe_load(EXAMPLE_SPEC.read_text())).model_dump(mode="json")


def make_task(name: str, folder: Path, budget_passes: int | None = None) -> Task:
    """The task `name` ('mnist1d' or 'tabular'); the tabular data is written to `folder`."""
    budget = budget_passes or 12
    base = example_spec()
    if name == "mnist1d":
        return Task("mnist1d", base, base["stop"]["target_accuracy"], budget)
    if name == "tabular":
        path = folder / "tabular.npz"
        np.savez(path, **tabular_arrays(0))
        spec = base | {
            "name": "tabular-mlp",
            "model": {"name": "mlp", "options": {"hidden": [64, 64]}},
            "dataset": {"source": f"npz:{path.resolve()}", "subsets": 4},
            "training": base["training"] | {"lr": 0.001},
        }
        return Task("tabular", JobSpec.model_validate(spec).model_dump(mode="json"), 0.88, budget)
    raise ValueError(f"--tasks: unknown task {name!r}; known: mnist1d, tabular")


def assimilation_for(rule: str) -> dict:
    """The assimilation section of rule configuration `rule` (`default`: the example job's)."""
    if rule not in RULE_CONFIGS:
        raise ValueError(f"--rules: unknown rule configuration {rule!r}; known: {', '.join(RULE_CONFIGS)}")
    return example_spec()["assimilation"] if rule == DEFAULT_RULE else RULE_CONFIGS[rule]


def _max_epochs(task: Task, args) -> int:
    """The system's budget: `--system-budget` times the baseline's examples, in job epochs
    (one epoch trains every shard `local_epochs` times)."""
    return math.ceil(task.budget_passes * args.system_budget / task.spec["training"]["local_epochs"])


def job_spec(task: Task, rule: str, seed: int, max_epochs: int, stop_at_target: bool) -> dict:
    """The job to submit: the task's spec with the rule's assimilation section and this run's stop rule."""
    target = task.target if stop_at_target else 1.0  # 1.0: run the whole budget, the target is read here
    return task.spec | {
        "name": f"efficiency-{task.name}-{rule}-s{seed}",
        "seed": seed,
        "assimilation": assimilation_for(rule),
        "stop": {"target_accuracy": target, "max_epochs": max_epochs},
    }


def unsupported_reason(spec: dict) -> str | None:
    """Why this code cannot run `spec`'s merge rule (None when it can): the spec is refused, or
    the rule registry does not know the rule."""
    try:
        stored = JobSpec.model_validate(spec).model_dump(mode="json")
    except ValidationError as exc:
        return "spec refused: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    try:
        make_rule(stored["assimilation"])
    except (ValueError, KeyError, NotImplementedError) as exc:
        return f"merge rule: {exc}"
    return None


# ---------------------------------------------------------------- pure measures


def examples_to_target(points: list[tuple[int, float]], target: float) -> int | None:
    """The examples at the first point (in order of examples) whose accuracy is >= `target`; None if none is."""
    for examples, accuracy in sorted(points, key=lambda p: p[0]):
        if accuracy >= target:
            return int(examples)
    return None


def best_accuracy(points: list[tuple[int, float]], max_examples: int | None = None) -> float | None:
    """The best accuracy among points with at most `max_examples` examples (all points if None)."""
    within = [a for e, a in points if max_examples is None or e <= max_examples]
    return max(within) if within else None


def merge_curve(merged: list[tuple[int, int]], metrics: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(examples merged so far, accuracy) per metric: `merged` holds (merged_version, examples) of
    each merged result, `metrics` (param_version, accuracy) of each evaluation of W_s."""
    versions = np.array(sorted(v for v, _ in merged), dtype=np.int64)
    cumulative = np.cumsum([e for _, e in sorted(merged)], dtype=np.int64)
    curve = []
    for version, accuracy in sorted(metrics, key=lambda m: m[0]):
        upto = int(np.searchsorted(versions, version, side="right"))
        curve.append((int(cumulative[upto - 1]) if upto else 0, float(accuracy)))
    return curve


def ratio(examples: int | None, baseline: int | None) -> float | None:
    return None if examples is None or not baseline else round(examples / baseline, 3)


UPLOAD_LINE = re.compile(r"assignment (\d+): result uploaded \((\d+) bytes")


def upload_sizes(log_text: str) -> dict[int, int]:
    """Bytes of each uploaded result, by assignment id, from the scheduler's log."""
    return {int(a): int(b) for a, b in UPLOAD_LINE.findall(log_text)}


# ---------------------------------------------------------------- baseline


class _EvaluateEvery:
    """The trainer's checkpoint hook used as an evaluation hook: every `every` examples the
    model's state is evaluated on the validation set (nothing is saved; training never resumes)."""

    resumed = None

    def __init__(self, every: int, n_train: int, score) -> None:
        self.every, self.n_train, self.score = every, n_train, score
        self.next_at = every
        self.points: list[tuple[int, float]] = []

    def due(self) -> bool:
        return True  # save() decides: it alone learns the position in the data

    def save(self, tensors: dict, progress: dict) -> None:
        examples = progress["epoch"] * self.n_train + progress["batch_start"]
        if examples >= self.next_at:
            self.points.append((examples, self.score({k: v for k, v in tensors.items() if not k.startswith("__")})))
            self.next_at = (examples // self.every + 1) * self.every


_BASELINE_IDS = itertools.count(1)


def baseline(task: Task, seed: int) -> dict:
    """One process: the job's model, initial W (seed), training recipe, over the whole training set."""
    spec = JobSpec.model_validate(task.spec)
    data = load_dataset(spec.dataset.source, spec.dataset.validation_fraction, spec.dataset.classes)
    model_config = {
        "name": spec.model.name,
        "framework": spec.framework,
        "input_shape": data.input_shape,
        "num_classes": data.num_classes,
        "options": spec.model.options,
    }
    params, _ = initial_parameters(model_config, seed, 1 << 40)
    recipe = {
        "model": model_config,
        "seed": seed,
        "training": task.spec["training"] | {"local_epochs": task.budget_passes},
    }

    cache_key = -next(_BASELINE_IDS)  # evaluate() caches one model per job id: one id per baseline

    def score(p: dict) -> float:
        return evaluate(cache_key, model_config, p, data.x_val, data.y_val, framework="pytorch")[1]

    shard = len(data.x) // spec.dataset.subsets
    hook = _EvaluateEvery(shard, len(data.x), score)
    start = time.monotonic()
    result = train("pytorch", recipe, params, data.x, data.y, checkpoint=hook)
    points = [*hook.points, (result.examples, score(result.params))]
    reached = examples_to_target(points, task.target)
    out = {
        "examples_to_target": reached,
        "best_accuracy": best_accuracy(points),
        "budget_examples": result.examples,
        "eval_every_examples": shard,
        "seconds": round(time.monotonic() - start, 1),
        "curve": points,
    }
    say(
        f"[{task.name}] baseline seed {seed}: target {task.target} at {reached} examples, best "
        f"{out['best_accuracy']:.4f} in {result.examples} examples ({out['seconds']}s)"
    )
    return out


# ---------------------------------------------------------------- the real system


def client_slots(slots: int, per_client: int) -> list[int]:
    """Task slots of each client process so that they add up to `slots`."""
    return [per_client] * (slots // per_client) + ([slots % per_client] if slots % per_client else [])


def _wait_for_job(cluster: Cluster, job_id: int, clients: list, timeout: float, label: str) -> str:
    """Poll the job until it ends (its status) or `timeout` passes ('timeout'); progress every 15 s."""
    deadline, shown = time.monotonic() + timeout, 0.0
    with cluster.admin() as http:
        while True:
            st = http.get(f"/v1/jobs/{job_id}").json()
            if st["status"] in TERMINAL:
                return st["status"]
            if time.monotonic() > deadline:
                return "timeout"
            if not all(s.alive for s in cluster.services) or not any(c.alive for c in clients):
                dead = [s.name for s in cluster.services + clients if not s.alive]
                raise RuntimeError(f"processes exited: {dead}\n" + "\n".join(s.tail(10) for s in clients))
            if time.monotonic() - shown > 15:
                shown = time.monotonic()
                best = st["best_epoch_accuracy"]
                say(
                    f"  {label}: epoch {st['current_epoch']}, {st['merges']} merges, best epoch accuracy "
                    + ("-" if best is None else f"{best:.4f}")
                )
            time.sleep(1.0)


def _job_figures(cluster: Cluster, job_id: int, target: float) -> dict:
    """Examples-vs-accuracy curve and costs of a job, from the database and the scheduler's log."""
    db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        started, finished, param_bytes = job.started_at, job.finished_at, job.param_bytes
        merged = s.execute(
            select(Assignment.id, Assignment.merged_version, Assignment.examples).where(
                Assignment.job_id == job_id, Assignment.merged_version.is_not(None)
            )
        ).all()
        metrics = s.execute(
            select(Metric.param_version, Metric.val_accuracy, Metric.created_at)
            .where(Metric.job_id == job_id)
            .order_by(Metric.param_version)
        ).all()
    db.kw["bind"].dispose()
    curve = merge_curve(
        [(m.merged_version, m.examples or 0) for m in merged], [(m.param_version, m.val_accuracy) for m in metrics]
    )
    hit = next((m for m, (_, a) in zip(metrics, curve, strict=True) if a >= target), None)
    log = cluster.var_dir / "logs" / "server.log"
    sizes = upload_sizes(log.read_text(errors="replace")) if log.exists() else {}
    uploaded = [sizes[m.id] for m in merged if m.id in sizes]
    end = finished or max((m.created_at for m in metrics), default=started)
    return {
        "curve": curve,
        "merges": len(merged),
        "param_bytes": param_bytes,
        "bytes_per_merge": round(statistics.mean(uploaded)) if uploaded else None,
        "wall_seconds": round((end - started).total_seconds(), 1) if started and end else None,
        "wall_seconds_to_target": round((hit.created_at - started).total_seconds(), 1)
        if hit is not None and started
        else None,
    }


def run_real(cluster: Cluster, task: Task, rule: str, slots: int, seed: int, base: dict, args) -> dict:
    """One job through the real system with `slots` task slots; its row of figures."""
    spec = job_spec(task, rule, seed, _max_epochs(task, args), args.stop_at_target)
    row = {"task": task.name, "rule": rule, "mode": "real", "slots": slots, "seed": seed}
    reason = unsupported_reason(spec)
    if reason:
        return row | {"status": "unsupported", "note": reason}
    label = f"[{task.name}] {rule} real {slots} slots seed {seed}"
    job_id = cluster.submit(spec)["job_id"]
    say(f"{label}: job {job_id}, up to {spec['stop']['max_epochs']} epochs")
    clients = [
        cluster.start_client(f"j{job_id}-c{i}", n) for i, n in enumerate(client_slots(slots, args.slots_per_client))
    ]
    try:
        status = _wait_for_job(cluster, job_id, clients, args.job_timeout, label)
    finally:
        with cluster.admin() as http:
            http.post(f"/v1/jobs/{job_id}/cancel")
        for c in clients:
            c.stop()
    figures = _job_figures(cluster, job_id, task.target)
    row |= _compare(figures["curve"], task, base) | figures | {"job_status": status}
    say(f"{label}: {_describe(row)}")
    return row


def _compare(curve: list[tuple[int, float]], task: Task, base: dict) -> dict:
    """A run's curve against its baseline: examples to target, ratio, best accuracies."""
    reached = examples_to_target(curve, task.target)
    row = {
        "examples_to_target": reached,
        "baseline_examples": base["examples_to_target"],
        "ratio": ratio(reached, base["examples_to_target"]),
        "best_accuracy": best_accuracy(curve),
        "best_accuracy_within_baseline_budget": best_accuracy(curve, base["budget_examples"]),
        "baseline_best_accuracy": base["best_accuracy"],
        "examples_seen": curve[-1][0] if curve else 0,
    }
    if base["examples_to_target"] is None:
        return row | {"status": "not reached", "note": "the single process did not reach the target"}
    if reached is None:
        return row | {
            "status": "not reached",
            "note": f"target {task.target} not reached in {row['examples_seen']} examples",
        }
    return row | {"status": "ok", "note": ""}


def _describe(row: dict) -> str:
    return (
        f"{row['status']}; ratio {row.get('ratio')}, best {row.get('best_accuracy')}, "
        f"{row.get('merges', '-')} merges, {row.get('bytes_per_merge', '-')} B/merge {row.get('note', '')}"
    )


# ---------------------------------------------------------------- the simulator


class SimulatorUnavailable(Exception):
    pass


_sim_data: dict[str, object] = {}  # dataset source -> Dataset, loaded once for every simulation


def simulate(spec: dict, slots: int, seed: int, args) -> tuple[list[tuple[int, float, float]], int]:
    """The simulator's curve for `spec` at `slots` slots, (examples, accuracy, simulated seconds)
    per validation of W_s, and its merges. The one adapter to crowdtrain.sim.training; raises SimulatorUnavailable
    while it is missing or its interface differs from the one used here."""
    try:
        from crowdtrain.sim.training import simulate_training  # type: ignore[import-not-found]
    except ImportError as exc:
        raise SimulatorUnavailable(f"crowdtrain.sim.training: {exc}") from None
    source = spec["dataset"]["source"]
    if source not in _sim_data:
        _sim_data[source] = load_dataset(source, spec["dataset"]["validation_fraction"], spec["dataset"]["classes"])
    per_host = min(slots, args.sim_slots_per_host)
    try:
        out = simulate_training(
            spec,
            hosts=math.ceil(slots / per_host),
            slots=per_host,
            p=args.sim_p,
            network_seconds=args.sim_network_seconds,
            seed=seed,
            data=_sim_data[source],
        )
        return [(int(m.examples), float(m.accuracy), float(m.time)) for m in out.metrics], int(out.merges)
    except (TypeError, AttributeError) as exc:
        raise SimulatorUnavailable(f"simulate_training's interface: {exc}") from None


_one_slot: dict[tuple, list] = {}


def run_simulated(task: Task, rule: str, slots: int, seed: int, base: dict, args) -> dict:
    """One simulated job at `slots` slots (and, once per task, rule and seed, at one slot for the
    speedup's reference); its row of figures."""
    spec = job_spec(task, rule, seed, _max_epochs(task, args), args.stop_at_target)
    row = {"task": task.name, "rule": rule, "mode": "sim", "slots": slots, "seed": seed}
    reason = unsupported_reason(spec)
    if reason:
        return row | {"status": "unsupported", "note": reason}
    try:
        curve, merges = simulate(spec, slots, seed, args)
        key = (task.name, rule, seed)
        if key not in _one_slot:  # the speedup's reference, shared by every slot count
            _one_slot[key] = curve if slots == 1 else simulate(spec, 1, seed, args)[0]
        one = _one_slot[key]
    except SimulatorUnavailable as exc:
        return row | {"status": "unavailable", "note": str(exc)}
    t_slots, t_one = _seconds_to_target(curve, task.target), _seconds_to_target(one, task.target)
    row |= _compare([(e, a) for e, a, _ in curve], task, base)
    row |= {
        "merges": merges,
        "curve": curve,
        "simulated_seconds_to_target": t_slots,
        "simulated_speedup": round(t_one / t_slots, 2) if t_one and t_slots else None,
    }
    say(f"[{task.name}] {rule} simulated {slots} slots seed {seed}: {_describe(row)}")
    return row


def _seconds_to_target(curve: list[tuple[int, float, float]], target: float) -> float | None:
    return next((t for _, a, t in sorted(curve) if a >= target), None)


# ---------------------------------------------------------------- report


SUMMED = (
    "examples_to_target",
    "baseline_examples",
    "best_accuracy",
    "best_accuracy_within_baseline_budget",
    "baseline_best_accuracy",
    "merges",
    "wall_seconds",
    "wall_seconds_to_target",
    "bytes_per_merge",
    "param_bytes",
    "simulated_seconds_to_target",
    "simulated_speedup",
)


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.mean(present), 4) if present else None


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (task, rule, mode, slots): means over seeds. The ratio is the mean over seeds
    only when every seed reached the target; otherwise it is null and the note says how many did."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["rule"], r["mode"], r["slots"]), []).append(r)
    out = []
    for (task, rule, mode, slots), rs in groups.items():
        ran = [r for r in rs if r["status"] in ("ok", "not reached")]
        reached = [r for r in ran if r["status"] == "ok"]
        every = bool(ran) and len(reached) == len(ran)
        s = {
            "task": task,
            "rule": rule,
            "mode": mode,
            "slots": slots,
            "seeds": len(rs),
            "reached": len(reached),
            "ratio": _mean([r["ratio"] for r in reached]) if every else None,
            **{k: _mean([r.get(k) for r in ran]) for k in SUMMED},
        }
        if not ran:  # unsupported, unavailable or failed: say why
            s |= {"status": rs[0]["status"], "note": rs[0]["note"]}
        elif every:
            s |= {"status": "ok", "note": ""}
        else:
            s |= {
                "status": "not reached",
                "note": f"target reached in {len(reached)} of {len(ran)} seeds: "
                + "; ".join(r["note"] for r in ran if r["note"]),
            }
        out.append(s)
    return out


def _cell(v) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def print_table(summary: list[dict]) -> None:
    t = Table(title="learning efficiency: examples to target / single-process examples")
    cols = {
        "task": "task",
        "rule": "rule",
        "mode": "mode",
        "slots": "slots",
        "ratio": "ratio",
        "examples_to_target": "examples",
        "baseline_examples": "1-process",
        "best_accuracy": "best acc",
        "best_accuracy_within_baseline_budget": "best in 1-p budget",
        "baseline_best_accuracy": "1-p best",
        "merges": "merges",
        "wall_seconds": "wall s",
        "bytes_per_merge": "B/merge",
        "simulated_speedup": "sim speedup",
        "status": "status",
    }
    for title in cols.values():
        t.add_column(title)
    for s in summary:
        t.add_row(*(_cell(s.get(c)) for c in cols))
    console.print(t)
    for s in summary:
        if s["note"]:
            say(f"  {s['task']} {s['rule']} {s['mode']} {s['slots']}: {s['note']}")


def headline(summary: list[dict], task: str, mode: str, slots: int) -> float | None:
    """The default rule's ratio for `task` at `slots` slots in `mode` (None when not measured or not reached)."""
    return next(
        (
            s["ratio"]
            for s in summary
            if (s["task"], s["rule"], s["mode"], s["slots"]) == (task, DEFAULT_RULE, mode, slots)
        ),
        None,
    )


# ---------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="mnist1d, default rule, 8 real and 64 simulated slots")
    ap.add_argument("--tasks", type=_names, default=["mnist1d", "tabular"], help="comma-separated: mnist1d,tabular")
    ap.add_argument("--rules", type=_names, default=list(RULE_CONFIGS), help="comma-separated rule configurations")
    ap.add_argument("--slots", type=_ints, default=[1, 4, 8], help="real-system task slots, comma-separated")
    ap.add_argument("--sim-slots", type=_ints, default=[8, 64, 256], help="simulated slots, comma-separated")
    ap.add_argument("--seeds", type=_ints, default=[0], help="comma-separated seeds (model init and job seed)")
    ap.add_argument("--out", type=Path, help="write every run's figures and curves (JSON) to this file")
    ap.add_argument("--slots-per-client", type=int, default=4, help="task slots per client process")
    ap.add_argument(
        "--budget-passes", type=int, help="the single process's passes over the training set (default: the task's, 12)"
    )
    ap.add_argument(
        "--system-budget", type=float, default=3.0, help="the system's example budget as a multiple of the baseline's"
    )
    ap.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end jobs at their target (shorter; best accuracy then stops near the target)",
    )
    ap.add_argument("--job-timeout", type=float, default=900.0, help="seconds one real-system job may run")
    ap.add_argument("--sim-slots-per-host", type=int, default=4)
    ap.add_argument("--sim-p", type=float, default=0.0, help="simulated preemption probability")
    ap.add_argument("--sim-network-seconds", type=float, default=0.1, help="simulated seconds per transfer")
    ap.add_argument("--assimilator-concurrency", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.rules, args.slots, args.sim_slots = ["mnist1d"], [DEFAULT_RULE], [8], [64]
    for rule in args.rules:
        assimilation_for(rule)  # an unknown name fails here, before anything starts
    if min(args.slots + args.sim_slots + [args.slots_per_client]) < 1:
        ap.error("slots must be >= 1")
    return args


def run(args: argparse.Namespace, tasks: list[Task], tmp: Path) -> tuple[list[dict], dict]:
    baselines = {(t.name, seed): baseline(t, seed) for t in tasks for seed in args.seeds}
    rows: list[dict] = []
    if args.slots:
        cluster = Cluster(var_dir=tmp / "cluster", assimilator_concurrency=args.assimilator_concurrency)
        say("starting the cluster (Redis, scheduler, transitioner, parameter servers) ...")
        cluster.start()
        try:
            for t in tasks:
                for rule in args.rules:
                    for slots in args.slots:
                        for seed in args.seeds:
                            rows.append(
                                _guarded(run_real, cluster, t, rule, slots, seed, baselines[t.name, seed], args)
                            )
        finally:
            cluster.stop()
    for t in tasks:
        for rule in args.rules:
            for slots in args.sim_slots:
                for seed in args.seeds:
                    rows.append(_guarded(run_simulated, t, rule, slots, seed, baselines[t.name, seed], args))
    return rows, {f"{name}/seed{seed}": b for (name, seed), b in baselines.items()}


def _guarded(fn, *a) -> dict:
    """A failed run is a row saying why, so that one rule's failure does not lose the others' figures."""
    task, rule, slots, seed = (a[1], a[2], a[3], a[4]) if fn is run_real else a[:4]
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001 -- reported in the row and on stderr
        say(f"[{task.name}] {rule} {slots} slots seed {seed}: error {exc}")
        return {
            "task": task.name,
            "rule": rule,
            "mode": "real" if fn is run_real else "sim",
            "slots": slots,
            "seed": seed,
            "status": "error",
            "note": str(exc)[:500],
        }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    limit_threads(1)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ct-efficiency-") as tmp:
        tasks = [make_task(name, Path(tmp), args.budget_passes) for name in args.tasks]
        rows, baselines = run(args, tasks, Path(tmp))
    summary = summarize(rows)
    print_table(summary)
    result = {
        "benchmark": "learning_efficiency",
        "quick": args.quick,
        "default_rule": DEFAULT_RULE,
        "default_assimilation": assimilation_for(DEFAULT_RULE),
        "seeds": args.seeds,
        "targets": {t.name: t.target for t in tasks},
        "baseline": {k: {kk: v for kk, v in b.items() if kk != "curve"} for k, b in baselines.items()},
        "results": summary,
        "ratio_8_slots": headline(summary, "mnist1d", "real", 8),
        "ratio_64_simulated": headline(summary, "mnist1d", "sim", 64),
        "goal": {"ratio_8_slots": 1.5, "ratio_64_simulated": 2.0},
        "seconds": round(time.monotonic() - start, 1),
    }
    if args.out:
        args.out.write_text(json.dumps(result | {"runs": rows, "baseline_curves": baselines}, indent=1))
        say(f"full results: {args.out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
