"""Learning efficiency: training examples each merge rule needs, against one process and the large-batch bound.

What it measures
    For each task, merge-rule configuration and slot count T: the training examples the system
    needs to first reach the task's target validation accuracy, divided by (1) the examples one
    process needs with the same model, initial weights, optimizer, learning rate and batch size B
    (the job spec's `training` section), and (2) `bound_ratio`: by the examples of the large-batch
    bound at T, one process at batch T*B with the best learning rate of a small sweep, which is the
    best any synchronous data-parallel method with T slots can do (DESIGN.md section 9). Also the
    best accuracy each reaches within its budget, the mean and max staleness of its merged results
    (merges between a result's base version and the version it was merged into), the merges, the
    wall time, the bytes uploaded per merge and, in the simulator, the wall-time speedup over one
    process. A ratio near 1 means volunteers' examples are worth as much as one machine's.

How
    Single processes: the clients' PyTorch trainer (client/trainers/pytorch.py) runs over the whole
    training set in one call (one optimizer, never reset), and W is evaluated on the validation set
    with the parameter servers' code (assimilator/evaluate.py) through the trainer's checkpoint hook
    every `eval_fraction` of the baseline's example budget (the task file's, by default 0.1%; or
    `--eval-fraction`), at the next batch boundary (never at a pass's first batch). The baseline
    runs the task's budget (`budget_passes` passes, or `--budget-passes`); `eval_gap_of_target` in
    its figures (and the bound's) is the largest gap between its evaluations as a fraction of its
    examples to target (<= 2% for every task below).
    Large-batch bound: for each T measured (real or simulated), one process at batch T*B with
    learning rates lr, lr*sqrt(T) and lr*T (lr: the task's; at most 10), each up to the system's
    budget (`--system-budget` x the baseline's passes), evaluated as often as the baseline (in
    examples) and stopped at the target; the one with the fewest examples to target is kept (the
    best accuracy when none reaches it). Where T*B exceeds the training set, a batch is the whole
    set (gradient descent); and as the trainer's hook is never called before a pass's first batch,
    a bound with few batches per pass is located to within a pass (its `eval_gap_of_target` says).
    Real system: one `Cluster` (private redis-server, scheduler on SQLite, transitioner, Celery
    parameter servers) for the whole run; per (task, rule, slots, seed) a job is submitted and
    clients with `--slots-per-client` task slots each are started; the job runs the baseline's
    budget x `--system-budget` in epochs (or stops at its target with `--stop-at-target`).
    Per-merge validation accuracy (table `metrics`) is paired with the examples of the results
    merged so far (`assignments.examples` of merged assignments with `merged_version` <= the
    metric's version); staleness is `merged_version` - 1 - `base_version` of each merged result.
    Upload sizes come from the scheduler's "result uploaded (N bytes" log lines.
    Simulator: `crowdtrain.sim.training.simulate_training`, through `simulate` in efficiency_runs.py.
    Speedup over one process (simulator rows only; on 2 shared cores the real system's wall time
    says nothing about T machines): one process's wall time to the target is modelled with the
    simulator's own timing model (crowdtrain/sim/hosts.py, `Fleet` with its defaults): one host of
    speed factor 1 computes `example_seconds` (1 ms) per training example, so it takes
    example_seconds x its examples to target, with no transfers, no merges and no preemption
    (efficiency_runs.one_process_seconds). T slots take the simulated seconds until W_s first
    reaches the target, with hosts of mean speed 1, `--sim-network-seconds` per transfer and
    `--sim-p` preemption. The speedup is their quotient: over one process, not over the same rule
    at one slot.
    Tasks: YAML files of benchmarks/tasks/ (efficiency_tasks.TaskFile: a job spec, on top of the
    spec file it `extends`; the data generator of efficiency_data.GENERATORS and its parameters;
    the target accuracy, the budget in passes and how often the baseline evaluates). Steps of batch
    32 one process needs to reach its target (seed 0, `--baseline-only`, 2026-11-27; the largest gap
    between evaluations before the target in brackets, as a fraction of the examples to target):
        mnist1d        examples/mnist1d-cnn.yaml, 1-D CNN, 4,000 examples, 0.90:    170 steps (1.8%)
        tabular        5 classes, 4,000 rows, MLP, 0.88:                            494 steps (0.6%)
        tabular-large  10 classes, 100,000 rows, MLP, 0.855:                      5,794 steps (0.3%)
        images         10 classes, 50,000 16x16 images, small ResNet, 0.70:       7,375 steps (0.8%)
    The last two reach their targets late in a slow climb (0.869 and 0.714 at most in their budgets
    of 6 and 8 passes), so their examples to target move by several % with the evaluation points, and
    with the arithmetic's rounding: images took 9,251 steps before its network ran channels-last
    (crowdtrain.core.zoo.PreActResNet; 7,375 on 2026-11-30, the same seed).
    Rules: `RULE_CONFIGS` (efficiency_tasks.py), named assimilation sections; `default` is the
    assimilation section of examples/mnist1d-cnn.yaml, i.e. what the project ships. A configuration
    the code does not know yet (spec refused, or `make_rule` raises) is reported "unsupported", not run.

Run
    .venv/bin/python benchmarks/learning_efficiency.py --quick
    .venv/bin/python benchmarks/learning_efficiency.py [--tasks mnist1d,tabular,tabular-large,images|PATH.yaml]
        [--rules default,delta,...] [--slots 1,4,8] [--sim-slots 8,64,256] [--seeds 0,1] [--out results.json]
    .venv/bin/python benchmarks/learning_efficiency.py --baseline-only --tasks PATH.yaml

`--quick`: mnist1d, the default rule, 8 slots on the real system, 8 and 64 in the simulator (280 s
on 2 cores that other work kept busy, load 9). Progress and a table go to stderr; the last line on stdout is one JSON
object with the figures, among them `ratio_8_slots`, `bound_ratio_8_slots` (`source_8_slots`
says real or simulated), `ratio_64_simulated` and `speedup_8_slots_vs_one_process` (simulated).

This module holds the command line and the loop over runs; beside it, imported by name from this
folder: efficiency_tasks.py (task files, rule configurations, the job spec of a run),
efficiency_data.py (the data generators), efficiency_runs.py (the single-process, real-system and
simulated runs) and efficiency_report.py (measures, summary, table).
"""

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from crowdtrain.client.trainers import limit_threads
from crowdtrain.launch.cluster import Cluster
from efficiency_report import against_bound, headline, print_table, say, summarize
from efficiency_runs import baseline, large_batch_bound, run_real, run_simulated
from efficiency_tasks import (
    DEFAULT_RULE,
    RULE_CONFIGS,
    Task,
    assimilation_for,
    known_tasks,
    make_task,
    read_task_file,
)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="mnist1d, default rule, 8 real and 8, 64 simulated slots")
    ap.add_argument(
        "--tasks",
        type=_names,
        default=["mnist1d", "tabular"],
        help=f"comma-separated task names ({', '.join(known_tasks())}: files of benchmarks/tasks/) or YAML paths",
    )
    ap.add_argument("--rules", type=_names, default=list(RULE_CONFIGS), help="comma-separated rule configurations")
    ap.add_argument("--slots", type=_ints, default=[1, 4, 8], help="real-system task slots, comma-separated")
    ap.add_argument("--sim-slots", type=_ints, default=[8, 64, 256], help="simulated slots, comma-separated")
    ap.add_argument("--seeds", type=_ints, default=[0], help="comma-separated seeds (model init and job seed)")
    ap.add_argument(
        "--baseline-only",
        action="store_true",
        help="run only each task's single process and print its steps to target (to size a new task)",
    )
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
    ap.add_argument(
        "--eval-fraction",
        type=float,
        help="the single process evaluates W every this fraction of its example budget (the bound as often); "
        "default: the task file's eval_fraction, 0.001 unless it says",
    )
    ap.add_argument("--job-timeout", type=float, default=900.0, help="seconds one real-system job may run")
    ap.add_argument("--sim-slots-per-host", type=int, default=4)
    ap.add_argument("--sim-p", type=float, default=0.0, help="simulated preemption probability")
    ap.add_argument("--sim-network-seconds", type=float, default=0.1, help="simulated seconds per transfer")
    ap.add_argument(
        "--snapshot-binding",
        choices=["dispatch", "start"],
        help="scheduling.snapshot_binding of every job, real and simulated: train from the snapshot published "
        "at dispatch, or from the newest when the slot starts the work (default: the task file's)",
    )
    ap.add_argument("--assimilator-concurrency", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.rules, args.slots, args.sim_slots = ["mnist1d"], [DEFAULT_RULE], [8], [8, 64]
    try:  # an unknown name or a bad task file fails here, before anything starts
        for rule in args.rules:
            assimilation_for(rule)
        for task in args.tasks:
            read_task_file(task)
    except ValueError as exc:
        ap.error(str(exc))
    if args.eval_fraction is not None and not 0 < args.eval_fraction <= 0.1:
        ap.error("--eval-fraction must lie in (0, 0.1]")
    if min(args.slots + args.sim_slots + [args.slots_per_client]) < 1:
        ap.error("slots must be >= 1")
    return args


def run(
    args: argparse.Namespace, tasks: list[Task], tmp: Path, progress: Callable[[list[dict], dict], None]
) -> tuple[list[dict], dict]:
    """Every run's row, and the single processes' figures (baselines and bounds); `progress` is given
    both after each run, so that a long benchmark stopped part way keeps what it measured."""
    baselines = {(t.name, seed): baseline(t, seed, args.eval_fraction) for t in tasks for seed in args.seeds}
    bounds = {
        (t.name, slots, seed): large_batch_bound(
            t,
            slots,
            seed,
            math.ceil(t.budget_passes * args.system_budget),
            baselines[t.name, seed]["eval_every_examples"],
        )
        for t in tasks
        for slots in sorted(set(args.slots + args.sim_slots))
        for seed in args.seeds
    }
    singles = {
        "baseline": {f"{name}/seed{seed}": b for (name, seed), b in baselines.items()},
        "bound": {f"{name}/{slots}slots/seed{seed}": b for (name, slots, seed), b in bounds.items()},
    }
    rows: list[dict] = []

    def add(row: dict) -> None:
        if row["status"] in ("ok", "not reached"):
            row |= against_bound(row["examples_to_target"], bounds[row["task"], row["slots"], row["seed"]])
        rows.append(row)
        progress(rows, singles)

    if args.slots:
        cluster = Cluster(var_dir=tmp / "cluster", assimilator_concurrency=args.assimilator_concurrency)
        say("starting the cluster (Redis, scheduler, transitioner, parameter servers) ...")
        cluster.start()
        try:
            for t in tasks:
                for rule in args.rules:
                    for slots in args.slots:
                        for seed in args.seeds:
                            add(_guarded(run_real, cluster, t, rule, slots, seed, baselines[t.name, seed], args))
        finally:
            cluster.stop()
    for t in tasks:
        for rule in args.rules:
            for slots in args.sim_slots:
                for seed in args.seeds:
                    add(_guarded(run_simulated, t, rule, slots, seed, baselines[t.name, seed], args))
    return rows, singles


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
    default = assimilation_for(DEFAULT_RULE)  # what `default` means for this run, read once
    with tempfile.TemporaryDirectory(prefix="ct-efficiency-") as tmp:
        try:
            tasks = [make_task(name, Path(tmp), args.budget_passes) for name in args.tasks]
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        if args.baseline_only:
            baselines_only(args, tasks)
            return

        def save(rows: list[dict], singles: dict, partial: bool) -> dict:
            """The result so far; with --out, also written (atomically) with every run's curves, marked
            `partial` until the last run is in."""
            result = outcome(args, rows, singles, tasks, default, start)
            if args.out:
                tmp_out = args.out.with_name(args.out.name + ".tmp")
                tmp_out.write_text(json.dumps(result | {"partial": partial, "runs": rows, "curves": singles}, indent=1))
                tmp_out.replace(args.out)
            return result

        rows, singles = run(args, tasks, Path(tmp), lambda rows, singles: save(rows, singles, partial=True))
        result = save(rows, singles, partial=False)
    print_table(result["results"])
    if args.out:
        say(f"full results: {args.out}")
    print(json.dumps(result))


def outcome(
    args: argparse.Namespace, rows: list[dict], singles: dict, tasks: list[Task], default: dict, start: float
) -> dict:
    """The benchmark's result: its settings, the single processes' figures, the summary rows and the
    headline figures."""
    summary = summarize(rows)
    return {
        "benchmark": "learning_efficiency",
        "quick": args.quick,
        "snapshot_binding": args.snapshot_binding,
        "default_rule": DEFAULT_RULE,
        "default_assimilation": default,
        "seeds": args.seeds,
        "targets": {t.name: t.target for t in tasks},
        "baseline": {k: _figures(b) for k, b in singles["baseline"].items()},
        "bound": {k: _figures(b) for k, b in singles["bound"].items()},
        "results": summary,
        **headlines(summary, args),
        "goal": {"ratio_8_slots": 1.5, "ratio_64_simulated": 2.0},
        "seconds": round(time.monotonic() - start, 1),
    }


def baselines_only(args: argparse.Namespace, tasks: list[Task]) -> None:
    """`--baseline-only`: each task's single process, its figures as one JSON line (curves: `--out`)."""
    singles = {f"{t.name}/seed{seed}": baseline(t, seed, args.eval_fraction) for t in tasks for seed in args.seeds}
    if args.out:
        args.out.write_text(json.dumps({"baseline": singles}, indent=1))
    figures = {k: _figures(b) for k, b in singles.items()}
    print(json.dumps({"benchmark": "learning_efficiency", "baseline": figures}))


def _figures(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "curve"}


def headlines(summary: list[dict], args: argparse.Namespace) -> dict:
    """The default rule's figures on mnist1d: at 8 slots from the real system when it ran them (else
    the simulator, as `source_8_slots` says), the speedup over one process from the simulator."""
    source = "real" if 8 in args.slots else "sim"
    return {
        "ratio_8_slots": headline(summary, "mnist1d", source, 8),
        "bound_ratio_8_slots": headline(summary, "mnist1d", source, 8, "bound_ratio"),
        "source_8_slots": "real" if source == "real" else "simulated",
        "ratio_64_simulated": headline(summary, "mnist1d", "sim", 64),
        "bound_ratio_64_simulated": headline(summary, "mnist1d", "sim", 64, "bound_ratio"),
        "speedup_8_slots_vs_one_process": headline(summary, "mnist1d", "sim", 8, "speedup"),
        "speedup_64_simulated_vs_one_process": headline(summary, "mnist1d", "sim", 64, "speedup"),
        "speedup_source": "simulated",
    }


if __name__ == "__main__":
    main()
