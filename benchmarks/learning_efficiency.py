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
    Simulator: `crowdtrain.sim.training.simulate_training`, through `simulate` in efficiency_runs.py.
    Tasks: `mnist1d` (examples/mnist1d-cnn.yaml) and `tabular`, a 5-class nonlinear Gaussian-
    mixture task generated in efficiency_tasks.py (`tabular_arrays`) and trained with an MLP.
    Rules: `RULE_CONFIGS` (efficiency_tasks.py), named assimilation sections; `default` is the
    assimilation section of examples/mnist1d-cnn.yaml, i.e. what the project ships. A configuration
    the code does not know yet (spec refused, or `make_rule` raises) is reported "unsupported", not run.

Run
    .venv/bin/python benchmarks/learning_efficiency.py --quick
    .venv/bin/python benchmarks/learning_efficiency.py [--tasks mnist1d,tabular] [--rules default,delta,...]
        [--slots 1,4,8] [--sim-slots 8,64,256] [--seeds 0,1] [--out results.json]

Progress and a table go to stderr; the last line on stdout is one JSON object with the figures.

This module holds the command line and the loop over runs; beside it, imported by name from this
folder: efficiency_tasks.py (tasks, rule configurations, the job spec of a run), efficiency_runs.py
(the baseline, real-system and simulated runs) and efficiency_report.py (measures, summary, table).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from crowdtrain.client.trainers import limit_threads
from crowdtrain.launch.cluster import Cluster
from efficiency_report import headline, print_table, say, summarize
from efficiency_runs import baseline, run_real, run_simulated
from efficiency_tasks import DEFAULT_RULE, RULE_CONFIGS, Task, assimilation_for, make_task


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
