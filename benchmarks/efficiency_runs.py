"""The runs of benchmarks/learning_efficiency.py: the single-process baseline, one job through the
real system, and one through the training simulator, each giving its row of figures. Not a
benchmark of its own: learning_efficiency.py imports it."""

import itertools
import math
import statistics
import time

from sqlalchemy import select

from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.client.trainers import train
from crowdtrain.core.jobspec import JobSpec
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job, Metric
from crowdtrain.sim.training import simulate_training
from crowdtrain.workgen.datasets import load_dataset
from crowdtrain.workgen.generator import initial_parameters
from efficiency_report import (
    best_accuracy,
    compare_to_baseline,
    describe,
    examples_to_target,
    merge_curve,
    say,
    upload_sizes,
)
from efficiency_tasks import Task, epoch_budget, job_spec, unsupported_reason
from job_progress import wait_for_job

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
    model_config = spec.configure_model(data.input_shape, data.num_classes)
    params = initial_parameters(model_config, seed, 1 << 40).params
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
    spec = job_spec(task, rule, seed, epoch_budget(task, args), args.stop_at_target)
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
        status = wait_for_job(cluster, job_id, clients, args.job_timeout, label, every_client=False)
    finally:
        with cluster.admin() as http:
            http.post(f"/v1/jobs/{job_id}/cancel")
        for c in clients:
            c.stop()
    figures = _job_figures(cluster, job_id, task.target)
    row |= compare_to_baseline(figures["curve"], task, base) | figures | {"job_status": status}
    say(f"{label}: {describe(row)}")
    return row


# ---------------------------------------------------------------- the simulator


_sim_data: dict[str, object] = {}  # dataset source -> Dataset, loaded once for every simulation


def simulate(spec: dict, slots: int, seed: int, args) -> tuple[list[tuple[int, float, float]], int]:
    """The simulator's curve for `spec` at `slots` slots, (examples, accuracy, simulated seconds)
    per validation of W_s, and its merges: the one adapter to crowdtrain.sim.training."""
    source = spec["dataset"]["source"]
    if source not in _sim_data:
        _sim_data[source] = load_dataset(source, spec["dataset"]["validation_fraction"], spec["dataset"]["classes"])
    per_host = min(slots, args.sim_slots_per_host)
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


_one_slot: dict[tuple, list] = {}


def run_simulated(task: Task, rule: str, slots: int, seed: int, base: dict, args) -> dict:
    """One simulated job at `slots` slots (and, once per task, rule and seed, at one slot for the
    speedup's reference); its row of figures."""
    spec = job_spec(task, rule, seed, epoch_budget(task, args), args.stop_at_target)
    row = {"task": task.name, "rule": rule, "mode": "sim", "slots": slots, "seed": seed}
    reason = unsupported_reason(spec)
    if reason:
        return row | {"status": "unsupported", "note": reason}
    curve, merges = simulate(spec, slots, seed, args)
    key = (task.name, rule, seed)
    if key not in _one_slot:  # the speedup's reference, shared by every slot count
        _one_slot[key] = curve if slots == 1 else simulate(spec, 1, seed, args)[0]
    one = _one_slot[key]
    t_slots, t_one = _seconds_to_target(curve, task.target), _seconds_to_target(one, task.target)
    row |= compare_to_baseline([(e, a) for e, a, _ in curve], task, base)
    row |= {
        "merges": merges,
        "curve": curve,
        "simulated_seconds_to_target": t_slots,
        "simulated_speedup": round(t_one / t_slots, 2) if t_one and t_slots else None,
    }
    say(f"[{task.name}] {rule} simulated {slots} slots seed {seed}: {describe(row)}")
    return row


def _seconds_to_target(curve: list[tuple[int, float, float]], target: float) -> float | None:
    return next((t for _, a, t in sorted(curve) if a >= target), None)
