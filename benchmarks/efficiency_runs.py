"""The runs of benchmarks/learning_efficiency.py: the single-process baseline and the large-batch
bound, one job through the real system, and one through the training simulator, each giving its
row of figures. Not a benchmark of its own: learning_efficiency.py imports it."""

import itertools
import math
import statistics
import time

import torch
from sqlalchemy import select

from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.client.trainers import Cancelled, TrainControl, train
from crowdtrain.core.jobspec import JobSpec
from crowdtrain.core.tensors import Params
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job, Metric
from crowdtrain.sim.hosts import Fleet
from crowdtrain.sim.result import SimResult
from crowdtrain.sim.training import simulate_training
from crowdtrain.workgen.datasets import Dataset, load_dataset
from crowdtrain.workgen.generator import initial_parameters
from efficiency_report import (
    best_accuracy,
    best_of_sweep,
    compare_to_baseline,
    describe,
    eval_gap,
    examples_to_target,
    merge_curve,
    say,
    speedup,
    staleness_figures,
    upload_sizes,
)
from efficiency_tasks import Task, bound_lrs, epoch_budget, job_spec, unsupported_reason
from job_progress import wait_for_job

# ---------------------------------------------------------------- baseline


class _EvaluateEvery:
    """The trainer's checkpoint hook used as an evaluation hook: every `every` examples the
    model's state is evaluated on the validation set (nothing is saved; training never resumes)."""

    resumed: tuple[Params, dict] | None = None

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


_BASELINE_IDS = itertools.count(10**9)  # apart from the simulator's -1, -2, ... (crowdtrain.sim.training)


class _StopAtTarget(TrainControl):
    """Stops a run (the trainer's Cancelled) once its hook has seen the target: a bound run needs
    only its examples to the target, and stopping there saves most of its budget."""

    def __init__(self, hook: _EvaluateEvery, target: float) -> None:
        super().__init__()
        self.hook, self.target = hook, target

    def between_batches(self) -> None:
        if self.hook.points and self.hook.points[-1][1] >= self.target:
            raise Cancelled()


def single_process(
    task: Task, seed: int, batch_size: int, lr: float, passes: int, eval_every: int, stop_at_target: bool
) -> dict:
    """One process: the job's model, initial W (seed) and optimizer at `batch_size` and `lr`, for
    `passes` passes over the whole training set in one trainer call (one optimizer, never reset),
    W evaluated every `eval_every` examples (at the next batch boundary) and at the end. Training
    runs on one CPU thread."""
    spec = JobSpec.model_validate(task.spec)
    data = _data(task.spec)
    model_config = spec.configure_model(data.input_shape, data.num_classes)
    params = initial_parameters(model_config, seed, 1 << 40).params
    training = task.spec["training"] | {"local_epochs": passes, "batch_size": batch_size, "lr": lr}
    recipe = {"model": model_config, "seed": seed, "training": training}
    cache_key = -next(_BASELINE_IDS)  # evaluate() caches one model per job id: one id per run

    def score(p: dict) -> float:
        return evaluate(cache_key, model_config, p, data.x_val, data.y_val, framework="pytorch")[1]

    hook = _EvaluateEvery(eval_every, len(data.x), score)
    control = _StopAtTarget(hook, task.target) if stop_at_target else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the simulator trains: on a busy machine more threads only wait
    start = time.monotonic()
    try:
        result = train("pytorch", recipe, params, data.x, data.y, control=control, checkpoint=hook)
        points = [*hook.points, (result.examples, score(result.params))]
    except Cancelled:
        points = hook.points
    finally:
        torch.set_num_threads(threads)
    reached = examples_to_target(points, task.target)
    return {
        "batch_size": batch_size,
        "lr": lr,
        "examples_to_target": reached,
        "steps_to_target": None if reached is None else math.ceil(reached / batch_size),
        "best_accuracy": best_accuracy(points),
        "budget_examples": passes * len(data.x),
        "eval_every_examples": eval_every,
        "eval_gap_of_target": eval_gap(points, reached),
        "seconds": round(time.monotonic() - start, 1),
        "curve": points,
    }


def baseline(task: Task, seed: int, eval_fraction: float | None = None) -> dict:
    """One process with the job's own training recipe, for the task's whole budget, evaluated every
    `eval_fraction` of that budget (None: the task's)."""
    t = task.spec["training"]
    fraction = task.eval_fraction if eval_fraction is None else eval_fraction
    every = max(1, round(fraction * task.budget_passes * len(_data(task.spec).x)))
    out = single_process(task, seed, t["batch_size"], t["lr"], task.budget_passes, every, False)
    say(
        f"[{task.name}] baseline seed {seed}: target {task.target} at {out['examples_to_target']} examples "
        f"({out['steps_to_target']} steps), best {out['best_accuracy']:.4f} in {out['budget_examples']} examples "
        f"({out['seconds']}s)"
    )
    return out


def large_batch_bound(task: Task, slots: int, seed: int, passes: int, eval_every: int) -> dict:
    """The large-batch bound at `slots` slots: one process at batch slots x B (B: the job's batch
    size), each learning rate of `bound_lrs` for up to `passes` passes, evaluated every `eval_every`
    examples (the baseline's interval: a bound rarely needs fewer examples than the baseline) and
    stopped at the target; the best of the sweep (`best_of_sweep`), with every run's figures under
    `sweep`."""
    t = task.spec["training"]
    runs = [
        single_process(task, seed, slots * t["batch_size"], lr, passes, eval_every, True)
        for lr in bound_lrs(t["lr"], slots)
    ]
    best = best_of_sweep(runs)
    say(
        f"[{task.name}] large-batch bound {slots} slots seed {seed}: batch {best['batch_size']}, lr {best['lr']:g}, "
        f"target at {best['examples_to_target']} examples ({sum(r['seconds'] for r in runs):.1f}s for "
        f"{len(runs)} learning rates)"
    )
    return best | {"sweep": [{k: v for k, v in r.items() if k != "curve"} for r in runs]}


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
            select(Assignment.id, Assignment.merged_version, Assignment.base_version, Assignment.examples).where(
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
    # merged_version is W_s's version after the merge: the result was merged into version - 1
    staleness = [m.merged_version - 1 - m.base_version for m in merged]
    return staleness_figures(staleness) | {
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
    spec = job_spec(task, rule, seed, epoch_budget(task, args), args.stop_at_target, args.snapshot_binding, slots)
    row = {"task": task.name, "rule": rule, "mode": "real", "slots": slots, "seed": seed}
    reason = unsupported_reason(spec)
    if reason:
        return row | {"status": "unsupported", "note": reason}
    label = f"[{task.name}] {rule} real {slots} slots seed {seed}"
    job_id = cluster.submit(spec)["job_id"]
    row["job_id"] = job_id
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


_data_of: dict[str, Dataset] = {}  # dataset source -> Dataset, loaded once for every run


def _data(spec: dict) -> Dataset:
    source = spec["dataset"]["source"]
    if source not in _data_of:
        _data_of[source] = load_dataset(source, spec["dataset"]["validation_fraction"], spec["dataset"]["classes"])
    return _data_of[source]


def simulate(spec: dict, slots: int, seed: int, args, timing: dict | None = None) -> SimResult:
    """The simulator's run of `spec` at `slots` slots: the one adapter to crowdtrain.sim.training.
    `timing` (crowdtrain.sim.calibration's, measured on a real run) replaces the defaults'."""
    per_host = min(slots, args.sim_slots_per_host)
    return simulate_training(
        spec,
        hosts=math.ceil(slots / per_host),
        slots=per_host,
        p=args.sim_p,
        seed=seed,
        data=_data(spec),
        **({"network_seconds": args.sim_network_seconds} | (timing or {})),
    )


def one_process_seconds(examples: int | None) -> float | None:
    """One process's wall time for `examples` training examples in the simulator's timing model
    (crowdtrain.sim.hosts.Fleet with the simulator's defaults): one host of speed 1 computing
    `example_seconds` per example, with no transfers, no merges and no preemption."""
    return None if examples is None else Fleet().work_seconds(examples, 1)


def run_simulated(task: Task, rule: str, slots: int, seed: int, base: dict, args, timing: dict | None = None) -> dict:
    """One simulated job at `slots` slots (with `timing`, see `simulate`); its row of figures, the
    wall-time speedup over one process (`one_process_seconds` of the baseline's examples to target)
    among them."""
    spec = job_spec(task, rule, seed, epoch_budget(task, args), args.stop_at_target, args.snapshot_binding, slots)
    row = {"task": task.name, "rule": rule, "mode": "sim", "slots": slots, "seed": seed}
    reason = unsupported_reason(spec)
    if reason:
        return row | {"status": "unsupported", "note": reason}
    out = simulate(spec, slots, seed, args, timing)
    curve = [(int(m.examples), float(m.accuracy), float(m.time)) for m in out.metrics]
    t_slots = _seconds_to_target(curve, task.target)
    t_one = one_process_seconds(base["examples_to_target"])
    row |= compare_to_baseline([(e, a) for e, a, _ in curve], task, base)
    row |= staleness_figures(out.staleness) | {
        "merges": int(out.merges),
        "mean_pass": round(statistics.fmean(out.passes), 2) if out.passes else None,
        "longest_backlog": out.longest_backlog,
        "curve": curve,
        "simulated_seconds_to_target": t_slots,
        "one_process_seconds_to_target": t_one,
        "speedup": speedup(t_one, t_slots),
    }
    say(f"[{task.name}] {rule} simulated {slots} slots seed {seed}: {describe(row)}")
    return row


def _seconds_to_target(curve: list[tuple[int, float, float]], target: float) -> float | None:
    return next((t for _, a, t in sorted(curve) if a >= target), None)
