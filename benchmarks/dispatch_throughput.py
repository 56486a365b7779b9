"""Work requests the scheduler serves per second on PostgreSQL, and what each costs in CPU, at
1k, 10k and 100k registered hosts and 20k and 200k ready workunits.

What it measures
    How many `POST /v1/work {"free_slots": 1}` requests per second 3 uvicorn workers in front of
    PostgreSQL answer, their p50/p95 latency, and the CPU milliseconds per request spent by the
    scheduler's processes and by PostgreSQL's (utime + stime from /proc, summed over the processes
    by process_cpu.py beside this script, divided by the requests answered in the same window). Each
    request is real HTTP from a random registered host and goes through everything a client's poll
    does: host authentication, the `last_seen` update, the claim of a ready workunit, the new
    assignment row, the telemetry counters in Redis and the JSON answer. No shard or snapshot is
    downloaded and nothing is uploaded: this is dispatch alone.

    The load generator (work_request_load.py beside this script) is lean on purpose, so that it
    measures the scheduler and not itself: raw HTTP/1.1 on asyncio streams over keep-alive
    connections, each request's bytes built once per host, the answer's assignments counted
    without parsing its JSON. Its own CPU per request is reported too
    (`loadgen_cpu_ms_per_request`); it shares the 2 cores with everything else.

    Beside our figure it prints BOINC's published one: about 8.8 million jobs a day, ~100 per
    second from one server (Anderson, Korpela and Walton, "High-Performance Task Distribution for
    Volunteer Computing", e-Science 2005).

How
    A fresh PostgreSQL database is created (and dropped at the end) and a real `Cluster` runs
    in a temporary directory: a private redis-server, the scheduler with 3 uvicorn workers, the
    transitioner and one Celery parameter server. A job is submitted through the admin API on a
    small random npz. The scale is then set directly in the database, which is what 100k HTTP
    registrations and 200k shard uploads would leave there, in a fraction of the time: hosts are
    inserted as rows (the sha256 of a random token each), and before every measured window the
    job's current epoch is topped up with shards (rows naming the job's one real shard object) and
    ready workunits, to the window's count. Windows run from the smallest scale to the largest.

Run
    .venv/bin/python benchmarks/dispatch_throughput.py [--seconds 10] [--concurrency 64]
        [--scales 1000:20000,10000:20000,100000:20000,10000:200000]

    PostgreSQL: CROWDTRAIN_BENCH_DATABASE_URL, else CROWDTRAIN_TEST_DATABASE_URL, else
    postgresql+psycopg://postgres@127.0.0.1:5432/test (any database on the server; the script
    creates its own beside it).

Progress goes to stderr; the last line on stdout is one JSON object: the headline figures (10k
hosts, 20k ready workunits) at its top level, and every window in `scales`.
"""

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from crowdtrain.launch.cluster import Cluster, fresh_postgres_database
from crowdtrain.server.ledger.db import normalize_url
from crowdtrain.server.ledger.models import Host
from crowdtrain.server.services.hosts import hash_token
from process_cpu import cpu_seconds
from work_request_load import Window, drive, work_requests

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SCHEDULER_WORKERS = 3
FEATURES = 8
NUM_CLASSES = 2
SHARDS_SUBMITTED = 8
VALIDATION_EXAMPLES = 16
MODEL = {"name": "mlp", "options": {"hidden": [8]}}
HEADLINE = (10_000, 20_000)
DEFAULT_SCALES = "1000:20000,10000:20000,100000:20000,10000:200000"
BOINC_JOBS_PER_S = 100  # ~8.8M jobs/day
BOINC_CITATION = (
    "BOINC: ~8.8M jobs/day, ~100/s from one server (Anderson, Korpela, Walton, "
    "'High-Performance Task Distribution for Volunteer Computing', e-Science 2005)"
)
GOAL_REQUESTS_PER_S = 1000
GOAL_SCHEDULER_CPU_MS = 1.5


def log(message: str) -> None:
    print(f"[dispatch_throughput] {message}", file=sys.stderr, flush=True)


# --- setup -------------------------------------------------------------------------------------


def admin_database_url() -> str:
    return normalize_url(
        os.environ.get("CROWDTRAIN_BENCH_DATABASE_URL") or os.environ.get("CROWDTRAIN_TEST_DATABASE_URL") or DEFAULT_PG
    )


def write_dataset(path: Path, seed: int = 0) -> None:
    """Random features, one example per shard, plus a tiny validation split."""
    rng = np.random.default_rng(seed)
    np.savez(
        path,
        x=rng.standard_normal((SHARDS_SUBMITTED, FEATURES), dtype=np.float32),
        y=np.arange(SHARDS_SUBMITTED, dtype=np.int64) % NUM_CLASSES,
        x_val=rng.standard_normal((VALIDATION_EXAMPLES, FEATURES), dtype=np.float32),
        y_val=np.arange(VALIDATION_EXAMPLES, dtype=np.int64) % NUM_CLASSES,
    )


def job_spec(dataset: Path) -> dict:
    """A job that never finishes by itself and whose assignments stay out for an hour."""
    return {
        "name": "dispatch-throughput-benchmark",
        "model": MODEL,
        "dataset": {"source": f"npz:{dataset}", "subsets": SHARDS_SUBMITTED},
        "stop": {"target_accuracy": 1.0, "max_epochs": 1000},
        "scheduling": {"deadline_seconds": 3600, "duplicate_after_seconds": None},
    }


def insert_hosts(engine: Engine, first: int, count: int) -> list[str]:
    """Register `count` more hosts as rows; returns their bearer tokens."""
    tokens = [secrets.token_urlsafe(32) for _ in range(count)]
    with Session(engine) as s, s.begin():
        s.execute(
            insert(Host),
            [
                {"name": f"bench-{first + i}", "token_hash": hash_token(t), "device": "cpu"}
                for i, t in enumerate(tokens)
            ],
        )
    return tokens


def top_up_ready(engine: Engine, job_id: int, ready: int) -> int:
    """Give the job's current epoch `ready` ready workunits, adding shard rows (copies of its first
    shard's reference) and workunits as needed; returns how many were added."""
    with engine.begin() as c:
        epoch = c.execute(text("SELECT current_epoch FROM jobs WHERE id = :j"), {"j": job_id}).scalar_one()
        have = c.execute(
            text("SELECT count(*) FROM workunits WHERE job_id = :j AND epoch = :e AND status = 'ready'"),
            {"j": job_id, "e": epoch},
        ).scalar_one()
        missing = max(0, ready - have)
        if missing == 0:
            return 0
        base = c.execute(
            text("SELECT coalesce(max(index), -1) + 1 FROM shards WHERE job_id = :j AND epoch = 0"), {"j": job_id}
        ).scalar_one()
        c.execute(
            text(
                "INSERT INTO shards (job_id, epoch, index, key, sha256, size, examples) "
                "SELECT s.job_id, 0, :base + g, s.key, s.sha256, s.size, s.examples "
                "FROM shards s, generate_series(0, :n - 1) g WHERE s.job_id = :j AND s.epoch = 0 AND s.index = 0"
            ),
            {"j": job_id, "base": base, "n": missing},
        )
        c.execute(
            text(
                "INSERT INTO workunits (job_id, epoch, shard_id, status, error_count, quorum, created_at) "
                "SELECT :j, :e, id, 'ready', 0, 1, now() FROM shards WHERE job_id = :j AND epoch = 0 AND index >= :base"
            ),
            {"j": job_id, "e": epoch, "base": base},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM ANALYZE workunits"))
        c.execute(text("VACUUM ANALYZE shards"))
    return missing


# --- one window ----------------------------------------------------------------------------------


def measure(cluster: Cluster, requests: list[bytes], concurrency: int, warmup: float, seconds: float) -> dict:
    server = next(svc for svc in cluster.services if svc.name == "server")
    assert server.proc is not None
    cpu_before: tuple[float, float] | None = None

    async def run() -> Window:
        nonlocal cpu_before
        task = asyncio.ensure_future(drive(cluster.port, requests, concurrency, warmup, seconds))
        await asyncio.sleep(warmup)
        cpu_before = cpu_seconds(server.proc.pid), time.process_time()  # type: ignore[union-attr]
        return await task

    window = asyncio.run(run())
    (sched_after, pg_after), loadgen_after = cpu_seconds(server.proc.pid), time.process_time()
    assert cpu_before is not None
    (sched_before, pg_before), loadgen_before = cpu_before
    answered = max(1, len(window.latencies))
    lat_ms = np.array(window.latencies or [float("nan")]) * 1000
    return {
        "requests_per_s": round(len(window.latencies) / seconds, 1),
        "dispatches_per_s": round(window.dispatches / seconds, 1),
        "p50_ms": round(float(np.percentile(lat_ms, 50)), 1),
        "p95_ms": round(float(np.percentile(lat_ms, 95)), 1),
        "scheduler_cpu_ms_per_request": round((sched_after - sched_before) * 1000 / answered, 3),
        "postgres_cpu_ms_per_request": round((pg_after - pg_before) * 1000 / answered, 3),
        "loadgen_cpu_ms_per_request": round((loadgen_after - loadgen_before) * 1000 / answered, 3),
        "requests": len(window.latencies),
        "errors": sum(window.status_codes.values()),
        "status_codes": window.status_codes,
        "transport_errors": window.transport_errors,
        "empty_replies": window.empty,
    }


def parse_scales(text_: str) -> list[tuple[int, int]]:
    scales = []
    for part in text_.split(","):
        hosts, _, ready = part.partition(":")
        scales.append((int(hosts), int(ready)))
    if any(h < 1 or r < 1 for h, r in scales):
        raise ValueError("every scale needs hosts >= 1 and ready workunits >= 1")
    return sorted(scales, key=lambda hr: (hr[1], hr[0]))  # ready workunits only grow between windows


def run(var_dir: Path, scales: list[tuple[int, int]], concurrency: int, warmup: float, seconds: float) -> dict:
    dataset = var_dir / "bench.npz"
    write_dataset(dataset)
    rows = []
    with fresh_postgres_database(admin_database_url()) as database_url:
        cluster = Cluster(
            var_dir=var_dir / "cluster",
            database_url=database_url,
            server_workers=SCHEDULER_WORKERS,
            assimilator_concurrency=1,
        )
        engine = create_engine(database_url)
        try:
            log(f"starting redis, the scheduler ({SCHEDULER_WORKERS} workers), the transitioner, a parameter server")
            cluster.start()
            job_id = cluster.submit(job_spec(dataset), timeout=300)["job_id"]
            tokens: list[str] = []
            for hosts, ready in scales:
                started = time.monotonic()
                if len(tokens) < hosts:
                    tokens += insert_hosts(engine, len(tokens), hosts - len(tokens))
                added = top_up_ready(engine, job_id, ready)
                log(
                    f"{hosts:,} hosts, {ready:,} ready workunits ({added:,} added) in "
                    f"{time.monotonic() - started:.1f}s; {concurrency} requests in flight, "
                    f"{warmup:.0f}s warm-up, {seconds:.0f}s measured ..."
                )
                figures = measure(cluster, work_requests(tokens[:hosts]), concurrency, warmup, seconds)
                log(
                    f"  {figures['requests_per_s']} requests/s, p50 {figures['p50_ms']} ms, "
                    f"p95 {figures['p95_ms']} ms; CPU ms per request: scheduler "
                    f"{figures['scheduler_cpu_ms_per_request']}, PostgreSQL {figures['postgres_cpu_ms_per_request']}, "
                    f"load generator {figures['loadgen_cpu_ms_per_request']}"
                )
                if figures["status_codes"] or figures["empty_replies"]:
                    log(f"  non-200 answers {figures['status_codes']}, empty answers {figures['empty_replies']}")
                rows.append({"registered_hosts": hosts, "ready_workunits": ready} | figures)
        finally:
            log("stopping the cluster")
            cluster.stop()
            engine.dispose()
    return report(rows, concurrency, seconds)


def report(rows: list[dict], concurrency: int, seconds: float) -> dict:
    headline = next(
        (r for r in rows if (r["registered_hosts"], r["ready_workunits"]) == HEADLINE), rows[len(rows) // 2]
    )
    return {
        "benchmark": "dispatch_throughput",
        "database": "postgresql",
        "scheduler_workers": SCHEDULER_WORKERS,
        "concurrency": concurrency,
        "seconds": seconds,
        **headline,
        "goal_requests_per_s": GOAL_REQUESTS_PER_S,
        "goal_scheduler_cpu_ms_per_request": GOAL_SCHEDULER_CPU_MS,
        "boinc_jobs_per_s": BOINC_JOBS_PER_S,
        "ratio_to_boinc": round(headline["dispatches_per_s"] / BOINC_JOBS_PER_S, 2),
        "boinc_source": BOINC_CITATION,
        "scales": rows,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per window, after the warm-up")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each window")
    parser.add_argument("--concurrency", type=int, default=64, help="work requests in flight at once")
    parser.add_argument(
        "--scales",
        default=DEFAULT_SCALES,
        help="windows as HOSTS:READY_WORKUNITS, comma-separated (run from the smallest to the largest)",
    )
    args = parser.parse_args()
    try:
        scales = parse_scales(args.scales)
    except ValueError as exc:
        parser.error(f"--scales: {exc}")
    if args.seconds <= 0 or args.warmup < 0 or args.concurrency < 1:
        parser.error("--seconds and --concurrency must be positive, --warmup not negative")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-bench-") as tmp:
        figures = run(Path(tmp), scales, args.concurrency, args.warmup, args.seconds)
    figures["wall_s"] = round(time.monotonic() - started, 1)
    log(BOINC_CITATION)
    log(
        f"ours at {figures['registered_hosts']:,} hosts: {figures['requests_per_s']} requests/s, p50 "
        f"{figures['p50_ms']} ms, scheduler CPU {figures['scheduler_cpu_ms_per_request']} ms/request "
        f"(goals: {GOAL_REQUESTS_PER_S}/s, {GOAL_SCHEDULER_CPU_MS} ms)"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
