"""The capacity model: CPU per workunit, per heartbeat and per empty poll of each server-side part,
measured on a real cluster, and the model built from them checked against runs of hosts that train.

What it measures
    For each model size (`--models`: zoo MLPs of about 3k and 1M parameters by default), a fresh
    PostgreSQL database and a real `Cluster` (private redis-server, the scheduler with
    `--scheduler-workers` uvicorn workers, the transitioner, one parameter server) serve simulated
    hosts (`crowdtrain simulate load`, a separate process, not counted). The CPU seconds of each part
    (the scheduler's process tree, the parameter server's, the transitioner's, redis-server and
    PostgreSQL's processes, read from /proc by process_cpu.py) are taken over windows of:
    - quiet: no host; each part's idle CPU per second (`idle_cpu_per_s`);
    - saturated: `--hosts` hosts that upload each workunit at once; CPU per workunit merged, the
      idle share taken off (`cpu_ms_per_workunit`): a work request, a snapshot download, an upload
      checked and stored, one merge, its share of the snapshots published and epochs closed;
    - heartbeats: hosts that hold their workunit for longer than the window, heartbeating every
      `--heartbeat` seconds; CPU per heartbeat (`cpu_ms_per_heartbeat`);
    - empty polls: the job cancelled, the hosts ask for work and are told to come back after the
      `retry_after` they get (at most 1 s here); CPU per empty work request (`cpu_ms_per_empty_poll`).
    Then the check: for each `--check HOSTS:SECONDS`, HOSTS hosts that hold each workunit SECONDS
    (heartbeating) run for `--seconds`, and the model's CPU per second of each part,
    idle + rate x (per workunit + heartbeats per workunit x per heartbeat), at the workunit rate the
    run reached, is set against what was measured (`measured_over_model`, per part); the rate
    against HOSTS / SECONDS, the rate a planner would assume (`rate_over_planned`).

How
    The job never finishes (target accuracy 1.0, many epochs) and has `--shards` workunits an epoch,
    so that hosts seldom wait at an epoch's end. Registrations happen before each window. The
    numbers are this machine's: the load generator and every part share its cores.

Run
    .venv/bin/python benchmarks/capacity.py [--seconds 15] [--hosts 16] [--models 3000,1000000]
        [--check 12:2,48:6] [--heartbeat 1] [--scheduler-workers 2]

    PostgreSQL: CROWDTRAIN_BENCH_DATABASE_URL, else CROWDTRAIN_TEST_DATABASE_URL, else
    postgresql+psycopg://postgres@127.0.0.1:5432/test (the script creates its own database beside it).

Progress goes to stderr; the last line on stdout is one JSON object: per model size, the unit costs
and the check's rows.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
from sqlalchemy import create_engine, text

from crowdtrain.core import keys
from crowdtrain.core.zoo import build_model, count_parameters
from crowdtrain.launch.cluster import Cluster, fresh_postgres_database
from dispatch_throughput import admin_database_url
from process_cpu import cpu_by_tree

PARTS = ("scheduler", "parameter_server", "transitioner", "redis", "postgres")
NUM_CLASSES = 10
EXAMPLES_PER_SHARD = 8


def log(message: str) -> None:
    print(f"[capacity] {message}", file=sys.stderr, flush=True)


def model_for(params: int) -> tuple[int, dict, int]:
    """(input features, model, its parameters) of a zoo MLP with about `params` parameters: one
    hidden layer of h units over 4h features, 10 classes (about 4h² parameters)."""
    hidden = max(4, round(math.sqrt(params / 4)))
    model = {"name": "mlp", "options": {"hidden": [hidden]}}
    return 4 * hidden, model, count_parameters(build_model("mlp", [4 * hidden], NUM_CLASSES, hidden=[hidden]))


def job_spec(dataset: Path, model: dict, shards: int) -> dict:
    return {
        "name": "capacity-benchmark",
        "model": model,
        "dataset": {"source": f"npz:{dataset}", "subsets": shards},
        "stop": {"target_accuracy": 1.0, "max_epochs": 100000},
        "scheduling": {"deadline_seconds": 3600, "duplicate_after_seconds": None},
        "assimilation": {"rule": "vc-asgd", "alpha": 0.9},
    }


def write_dataset(path: Path, features: int, shards: int) -> None:
    rng = np.random.default_rng(0)
    n = shards * EXAMPLES_PER_SHARD
    np.savez(
        path,
        x=rng.standard_normal((n, features), dtype=np.float32),
        y=np.arange(n, dtype=np.int64) % NUM_CLASSES,
        x_val=rng.standard_normal((16, features), dtype=np.float32),
        y_val=np.arange(16, dtype=np.int64) % NUM_CLASSES,
    )


class Meter:
    """The CPU seconds of each part of `cluster`, its merges so far (W_s's version), and whether
    every uploaded result is merged."""

    def __init__(self, cluster: Cluster, job_id: int):
        self.engine = create_engine(cluster.database_url)
        pids = {svc.name: svc.proc.pid for svc in cluster.services if svc.proc is not None}
        self.roots = {
            "scheduler": pids["server"],
            "parameter_server": pids["assimilator"],
            "transitioner": pids["transitioner"],
            "redis": pids["redis"],
        }
        self.r = redis.Redis.from_url(cluster.redis_url)
        self.job_id = job_id

    def read(self) -> tuple[float, dict[str, float], int]:
        version = int(self.r.get(keys.version(self.job_id)) or 0)
        return time.monotonic(), cpu_by_tree(self.roots), version

    def statuses(self) -> dict[str, int]:
        """The job's assignments by status."""
        query = text("SELECT status, count(*) FROM assignments WHERE job_id = :j GROUP BY status")
        with self.engine.connect() as c:
            return {status: n for status, n in c.execute(query, {"j": self.job_id}).all()}

    def drain(self, timeout: float = 300.0) -> None:
        """Wait until no result of the job waits for its merge."""
        ends = time.monotonic() + timeout
        query = text("SELECT count(*) FROM assignments WHERE job_id = :j AND status = 'uploaded'")
        while time.monotonic() < ends:
            with self.engine.connect() as c:
                if c.execute(query, {"j": self.job_id}).scalar_one() == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError("the parameter server did not catch up with the uploads")


def per_second(before: tuple, after: tuple) -> tuple[float, dict[str, float], int]:
    """(seconds, each part's CPU seconds per second, merges) between two readings."""
    seconds = after[0] - before[0]
    return seconds, {p: (after[1][p] - before[1][p]) / seconds for p in PARTS}, after[2] - before[2]


def simulate(
    cluster: Cluster,
    hosts: int,
    seconds: float,
    train_seconds: float,
    meter: Meter,
    warmup: float,
    drained: bool = False,
) -> dict:
    """Run `hosts` simulated hosts for `warmup` + `seconds`; the CPU per second of each part over the
    last `seconds`, the merges in them, and the load generator's figures. `drained`: the window
    runs on until every result uploaded is merged (so that its CPU is that of whole workunits)."""
    argv = [sys.executable, "-m", "crowdtrain", "simulate", "load", "--server", cluster.url]
    argv += ["--hosts", str(hosts), "--duration", str(warmup + seconds), "--train-seconds", str(train_seconds)]
    sim = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.client_env)
    time.sleep(warmup)
    before = meter.read()
    if drained:
        out, err = sim.communicate(timeout=600)
        meter.drain()
        after = meter.read()
    else:
        time.sleep(seconds)
        after = meter.read()
        out, err = sim.communicate(timeout=600)
    if sim.returncode != 0:
        raise RuntimeError(f"the load generator failed: {err[-2000:]}")
    window, cpu, merges = per_second(before, after)
    load = json.loads(out.strip().splitlines()[-1])
    log(
        f"  {merges} merges in {window:.1f}s; the hosts: {load['work_requests']} work requests, "
        f"{load['dispatched']} dispatched, {load['uploads']} uploads, {load['heartbeats']} heartbeats, "
        f"{load['refused']} refused, {load['server_errors']} server errors; assignments now {meter.statuses()}"
    )
    return {"seconds": window, "cpu_per_s": cpu, "merges": merges, "load": load}


def unit_costs(cluster: Cluster, job_id: int, args: argparse.Namespace) -> tuple[Meter, dict]:
    meter = Meter(cluster, job_id)
    log("quiet window (no host)")
    before = meter.read()
    time.sleep(args.seconds / 2)
    _, idle, _ = per_second(before, meter.read())
    log(f"saturated window: {args.hosts} hosts uploading at once, until their results are merged")
    simulate(cluster, args.hosts, 3.0, 0.0, meter, warmup=0.0, drained=True)  # warm-up: every process's first work
    sat = simulate(cluster, args.hosts, args.seconds, 0.0, meter, warmup=0.0, drained=True)
    rate = sat["merges"] / sat["seconds"]
    per_workunit = {p: (sat["cpu_per_s"][p] - idle[p]) * 1000 / max(rate, 1e-9) for p in PARTS}
    holders = args.hosts * 2
    log(f"heartbeat window: {holders} hosts holding their workunits")
    held = simulate(cluster, holders, args.seconds, 10 * (args.seconds + 10), meter, warmup=4.0)
    beats = holders / args.heartbeat  # per second, every holder once an interval
    per_heartbeat = {p: (held["cpu_per_s"][p] - idle[p]) * 1000 / beats for p in PARTS}
    return meter, {
        "idle_cpu_per_s": _rounded(idle, 4),
        "saturated_workunits_per_s": round(rate, 1),
        "saturated_work_p95_ms": sat["load"]["work_p95_ms"],
        "cpu_ms_per_workunit": _rounded(per_workunit, 2),
        "cpu_ms_per_heartbeat": _rounded(per_heartbeat, 3),
    }


def empty_polls(cluster: Cluster, job_id: int, meter: Meter, idle: dict, args: argparse.Namespace) -> dict:
    with cluster.admin() as http:
        http.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
    polling = args.hosts * 2
    log(f"empty polls: the job cancelled, {polling} hosts asking for work")
    run = simulate(cluster, polling, args.seconds, 0.0, meter, warmup=3.0)
    polls = run["load"]["requests"] / (run["load"]["seconds"] or 1)
    return _rounded({p: (run["cpu_per_s"][p] - idle[p]) * 1000 / max(polls, 1e-9) for p in PARTS}, 3)


def check(cluster: Cluster, meter: Meter, costs: dict, hosts: int, train: float, args: argparse.Namespace) -> dict:
    log(f"check: {hosts} hosts holding each workunit {train}s")
    run = simulate(cluster, hosts, args.seconds, train, meter, warmup=train + 2.0)
    rate = run["merges"] / run["seconds"]
    beats_per_workunit = math.ceil(train / args.heartbeat) - 1
    model = {
        p: costs["idle_cpu_per_s"][p]
        + rate * (costs["cpu_ms_per_workunit"][p] + beats_per_workunit * costs["cpu_ms_per_heartbeat"][p]) / 1000
        for p in PARTS
    }
    # What a workunit cost here, the idle share and the heartbeats taken off: at a light load a merge
    # pass holds fewer results than when saturated, so each pays more of a pass's fixed work.
    here = {
        p: (run["cpu_per_s"][p] - costs["idle_cpu_per_s"][p]) * 1000 / max(rate, 1e-9)
        - beats_per_workunit * costs["cpu_ms_per_heartbeat"][p]
        for p in PARTS
    }
    return {
        "hosts": hosts,
        "train_seconds": train,
        "cpu_ms_per_workunit_here": _rounded(here, 2),
        "workunits_per_s": round(rate, 2),
        "planned_workunits_per_s": round(hosts / train, 2),
        "rate_over_planned": round(rate * train / hosts, 2),
        "measured_cpu_per_s": _rounded(run["cpu_per_s"], 4),
        "model_cpu_per_s": _rounded(model, 4),
        "measured_over_model": {p: round(run["cpu_per_s"][p] / model[p], 2) if model[p] > 0 else None for p in PARTS},
    }


def _rounded(figures: dict[str, float], digits: int) -> dict[str, float]:
    return {k: round(v, digits) for k, v in figures.items()}


def run_model(var_dir: Path, params: int, args: argparse.Namespace) -> dict:
    features, model, exact = model_for(params)
    dataset = var_dir / f"data-{params}.npz"
    write_dataset(dataset, features, args.shards)
    with fresh_postgres_database(admin_database_url()) as database_url:
        cluster = Cluster(
            var_dir=var_dir / f"cluster-{params}",
            database_url=database_url,
            server_workers=args.scheduler_workers,
            assimilator_concurrency=1,
            extra_env={"CROWDTRAIN_HEARTBEAT_INTERVAL": str(args.heartbeat)},
        )
        try:
            log(f"model of ~{params:,} parameters: starting the cluster")
            cluster.start()
            job_id = cluster.submit(job_spec(dataset, model, args.shards), timeout=300)["job_id"]
            meter, costs = unit_costs(cluster, job_id, args)
            log(f"  {json.dumps(costs)}")
            checks = [check(cluster, meter, costs, hosts, train, args) for hosts, train in args.check]
            for row in checks:
                log(f"  {json.dumps(row)}")
            costs["cpu_ms_per_empty_poll"] = empty_polls(cluster, job_id, meter, costs["idle_cpu_per_s"], args)
        finally:
            cluster.stop()
    return {"parameters": exact, "model": model, **costs, "check": checks}


def parse_checks(text: str) -> list[tuple[int, float]]:
    out = []
    for part in text.split(","):
        hosts, _, seconds = part.partition(":")
        out.append((int(hosts), float(seconds)))
    if any(h < 1 or s <= 0 for h, s in out):
        raise ValueError("each check needs HOSTS >= 1 and SECONDS > 0")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds of each window")
    parser.add_argument("--hosts", type=int, default=16, help="hosts of the saturated window")
    parser.add_argument("--models", default="3000,1000000", help="model sizes (parameters), comma-separated")
    parser.add_argument("--check", default="12:2,48:6", help="check runs as HOSTS:WORKUNIT_SECONDS, comma-separated")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="the scheduler's heartbeat interval (seconds)")
    parser.add_argument("--shards", type=int, default=400, help="workunits per epoch")
    parser.add_argument("--scheduler-workers", type=int, default=2, help="uvicorn workers of the scheduler")
    args = parser.parse_args()
    try:
        args.check = parse_checks(args.check)
        models = [int(m) for m in args.models.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    if args.seconds <= 0 or args.hosts < 1 or args.heartbeat <= 0 or args.shards < 1 or min(models) < 100:
        parser.error("--seconds, --hosts, --heartbeat and --shards must be positive, models of 100 parameters or more")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-capacity-") as tmp:
        rows = [run_model(Path(tmp), params, args) for params in models]
    print(
        json.dumps(
            {
                "benchmark": "capacity",
                "database": "postgresql",
                "scheduler_workers": args.scheduler_workers,
                "heartbeat_s": args.heartbeat,
                "seconds": args.seconds,
                "models": rows,
                "cpus": os.cpu_count(),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "wall_s": round(time.monotonic() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
