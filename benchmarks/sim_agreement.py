"""Simulator against the real system: the same jobs, run for real and replayed in the simulator.

What it measures
    For each task, merge-rule configuration and slot count T: one job through the real system (a
    `Cluster`: private redis-server, scheduler on SQLite, transitioner, Celery parameter servers, and
    client processes of `--slots-per-client` slots), then the same job spec in the training
    simulator (crowdtrain.sim.training) with the timing measured on that real run
    (crowdtrain.sim.calibration: a slot's seconds per example, the hosts' spread and each
    assignment's, one transfer, a merge pass's and an evaluation's service times). Compared: the examples to the
    task's target as a ratio to one process (`ratio`, as benchmarks/learning_efficiency.py
    measures it) and the mean staleness of merged results. `ratio_gap` and `staleness_gap` are
    |sim - real| / real; the goal is <= 0.15 for both, at 4 and 8 slots, on two tasks and two rules.
    The simulator is seeded as the real job is (model, shards, training); what it cannot copy is
    the order in which a loaded machine lets results arrive, so one seed's gap mixes model error
    with that noise: several seeds (`--seeds`) say how much of each.

Run
    .venv/bin/python benchmarks/sim_agreement.py [--tasks mnist1d,tabular] [--rules default,delta]
        [--slots 4,8] [--seeds 0] [--out agreement.json]

Progress and a table go to stderr; the last line on stdout is one JSON object.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from crowdtrain.client.trainers import limit_threads
from crowdtrain.launch.cluster import Cluster
from crowdtrain.sim.calibration import measure
from efficiency_report import say
from efficiency_runs import baseline, run_real, run_simulated
from efficiency_tasks import DEFAULT_RULE, assimilation_for, make_task, read_task_file

GOAL = 0.15  # |sim - real| / real, for the ratio and the mean staleness


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=_names, default=["mnist1d", "tabular"], help="task names or YAML paths")
    ap.add_argument("--rules", type=_names, default=[DEFAULT_RULE, "delta"], help="rule configurations")
    ap.add_argument("--slots", type=_ints, default=[4, 8], help="task slots, comma-separated")
    ap.add_argument("--seeds", type=_ints, default=[0], help="comma-separated seeds")
    ap.add_argument("--slots-per-client", type=int, default=4, help="task slots per client process")
    ap.add_argument("--system-budget", type=float, default=3.0, help="job budget as a multiple of the baseline's")
    ap.add_argument("--job-timeout", type=float, default=900.0, help="seconds one real job may run")
    ap.add_argument(
        "--snapshot-binding",
        choices=["dispatch", "start"],
        help="scheduling.snapshot_binding of the jobs (the replays follow it); default: the task file's",
    )
    ap.add_argument("--out", type=Path, help="write every row, calibration included, to this JSON file")
    args = ap.parse_args(argv)
    try:
        for rule in args.rules:
            assimilation_for(rule)
        for task in args.tasks:
            read_task_file(task)
    except ValueError as exc:
        ap.error(str(exc))
    if min(args.slots + [args.slots_per_client]) < 1:
        ap.error("slots must be >= 1")
    # What efficiency_runs reads from learning_efficiency's arguments, fixed here.
    args.stop_at_target, args.budget_passes, args.eval_fraction = True, None, None
    args.sim_slots_per_host, args.sim_p, args.sim_network_seconds = args.slots_per_client, 0.0, 0.1
    return args


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def gap(sim: float | None, real: float | None) -> float | None:
    """|sim - real| / real; None when either is missing or real is 0."""
    if sim is None or real is None or real == 0:
        return None
    return round(abs(sim - real) / real, 3)


def compare(real: dict, sim: dict) -> dict:
    """One row of the agreement table from a real run's row and its replay's."""
    return {
        "task": real["task"],
        "rule": real["rule"],
        "slots": real["slots"],
        "seed": real["seed"],
        "real_ratio": real.get("ratio"),
        "sim_ratio": sim.get("ratio"),
        "ratio_gap": gap(sim.get("ratio"), real.get("ratio")),
        "real_staleness": real.get("staleness_mean"),
        "sim_staleness": sim.get("staleness_mean"),
        "staleness_gap": gap(sim.get("staleness_mean"), real.get("staleness_mean")),
        "real_status": real["status"],
        "sim_status": sim["status"],
    }


def run(args: argparse.Namespace, tmp: Path) -> list[dict]:
    tasks = [make_task(name, tmp, None) for name in args.tasks]
    baselines = {(t.name, s): baseline(t, s, None) for t in tasks for s in args.seeds}
    rows = []
    cluster = Cluster(var_dir=tmp / "cluster")
    say("starting the cluster (Redis, scheduler, transitioner, parameter servers) ...")
    cluster.start()
    try:
        for t in tasks:
            for rule in args.rules:
                for slots in args.slots:
                    for seed in args.seeds:
                        base = baselines[t.name, seed]
                        real = run_real(cluster, t, rule, slots, seed, base, args)
                        if "job_id" not in real:
                            rows.append(compare(real, {"status": real["status"]}))
                            continue
                        timing = measure(
                            f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}", cluster.redis_url, real["job_id"]
                        )
                        sim = run_simulated(t, rule, slots, seed, base, args, timing.sim_settings())
                        row = compare(real, sim) | {"timing": timing.figures()}
                        row |= {"real_mean_pass": timing.mean_pass, "sim_mean_pass": sim.get("mean_pass")}
                        say(f"[{t.name}] {rule} {slots} slots seed {seed}: {_line(row)}; timing {timing.figures()}")
                        rows.append(row)
    finally:
        cluster.stop()
    return rows


def _line(row: dict) -> str:
    return (
        f"ratio real {row['real_ratio']} sim {row['sim_ratio']} (gap {row['ratio_gap']}); staleness real "
        f"{row['real_staleness']} sim {row['sim_staleness']} (gap {row['staleness_gap']})"
    )


def print_table(rows: list[dict]) -> None:
    say(
        f"{'task':<14}{'rule':<10}{'slots':>6}{'seed':>5}  {'ratio real/sim (gap)':<26}{'staleness real/sim (gap)':<28}"
    )
    for r in rows:
        ratio = "{} / {} ({})".format(r["real_ratio"], r["sim_ratio"], r["ratio_gap"])
        staleness = "{} / {} ({})".format(r["real_staleness"], r["sim_staleness"], r["staleness_gap"])
        say(f"{r['task']:<14}{r['rule']:<10}{r['slots']:>6}{r['seed']:>5}  {ratio:<26}{staleness:<28}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    limit_threads(1)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ct-agreement-") as tmp:
        rows = run(args, Path(tmp))
    print_table(rows)
    gaps = {k: [r[k] for r in rows if r.get(k) is not None] for k in ("ratio_gap", "staleness_gap")}
    result = {
        "benchmark": "sim_agreement",
        "snapshot_binding": args.snapshot_binding,
        "rows": [{k: v for k, v in r.items() if k != "timing"} for r in rows],
        "max_ratio_gap": max(gaps["ratio_gap"], default=None),
        "max_staleness_gap": max(gaps["staleness_gap"], default=None),
        "within_goal": sum(
            1 for r in rows if r.get("ratio_gap") is not None and max(r["ratio_gap"], r["staleness_gap"] or 0) <= GOAL
        ),
        "compared": sum(1 for r in rows if r.get("ratio_gap") is not None),
        "goal_gap": GOAL,
        "seconds": round(time.monotonic() - start, 1),
    }
    if args.out:
        args.out.write_text(json.dumps(result | {"rows": rows}, indent=1))
        say(f"full results: {args.out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
