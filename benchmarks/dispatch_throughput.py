"""Work requests the scheduler serves per second on PostgreSQL, with 10,000 registered hosts.

What it measures
    How many `POST /v1/work {"free_slots": 1}` requests per second the scheduler answers, how
    many assignments those answers hand out, and the p50/p95 latency of one work request, with
    3 uvicorn workers in front of PostgreSQL and 10,000 hosts registered. Each request is real
    HTTP from a random one of the 10,000 hosts and goes through everything a client's poll does:
    host authentication, the `last_seen` update, the `FOR UPDATE SKIP LOCKED` claim of a ready
    workunit, the new assignment row, the telemetry counters in Redis and the JSON answer. No
    shard or snapshot is downloaded and nothing is uploaded: this is dispatch alone.

    Beside our figure it prints BOINC's published one: about 8.8 million jobs a day, ~100 per
    second (Anderson, "BOINC: A Platform for Volunteer Computing", J. Grid Computing 2020).

How
    A fresh PostgreSQL database is created (and dropped at the end) and a real `Cluster` runs
    in a temporary directory: a private redis-server, the scheduler with 3 uvicorn workers, the
    transitioner and one Celery parameter server. A job is submitted through the admin API on a
    small random npz cut into many one-example shards, so that work does not run out during the
    run (epoch 1 holds one workunit per shard; early release adds epoch 2 once it is all handed
    out, and no more, since nothing is ever uploaded).

    Setup inserts the 10,000 hosts as rows (`crowdtrain.server.ledger.models.Host` with the sha256 of a random
    token, in one transaction) rather than making 10,000 HTTP registrations; only the measured
    work requests go over HTTP.

    The load is one asyncio/httpx client with `--concurrency` requests in flight at all times.
    After `--warmup` seconds, only requests that complete inside the next `--seconds` are counted.
    The load generator shares the machine with the scheduler and PostgreSQL, so on a small
    machine it competes with them for CPU: the figures are a lower bound for the server alone.

Run
    .venv/bin/python benchmarks/dispatch_throughput.py [--seconds 30] [--concurrency 64]

    PostgreSQL: CROWDTRAIN_BENCH_DATABASE_URL, else CROWDTRAIN_TEST_DATABASE_URL, else
    postgresql+psycopg://postgres@127.0.0.1:5432/test (any database on the server; the script
    creates its own beside it).

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, insert
from sqlalchemy.orm import Session

from crowdtrain.launch.cluster import Cluster, fresh_postgres_database
from crowdtrain.server.ledger.db import normalize_url
from crowdtrain.server.ledger.models import Host
from crowdtrain.server.services.hosts import hash_token

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SCHEDULER_WORKERS = 3
FEATURES = 8
NUM_CLASSES = 2
VALIDATION_EXAMPLES = 16
MODEL = {"name": "mlp", "options": {"hidden": [8]}}
BOINC_JOBS_PER_S = 100  # ~8.8M jobs/day
BOINC_CITATION = (
    "BOINC: ~8.8M jobs/day, ~100/s (Anderson, 'BOINC: A Platform for Volunteer Computing', J. Grid Computing 2020)"
)
PROGRESS_EVERY_S = 5.0


def log(message: str) -> None:
    print(f"[dispatch_throughput] {message}", file=sys.stderr, flush=True)


# --- setup -------------------------------------------------------------------------------------


def admin_database_url() -> str:
    return normalize_url(
        os.environ.get("CROWDTRAIN_BENCH_DATABASE_URL") or os.environ.get("CROWDTRAIN_TEST_DATABASE_URL") or DEFAULT_PG
    )


def write_dataset(path: Path, shards: int, seed: int = 0) -> None:
    """Random features, one example per shard, plus a tiny validation split."""
    rng = np.random.default_rng(seed)
    np.savez(
        path,
        x=rng.standard_normal((shards, FEATURES), dtype=np.float32),
        y=np.arange(shards, dtype=np.int64) % NUM_CLASSES,
        x_val=rng.standard_normal((VALIDATION_EXAMPLES, FEATURES), dtype=np.float32),
        y_val=np.arange(VALIDATION_EXAMPLES, dtype=np.int64) % NUM_CLASSES,
    )


def job_spec(dataset: Path, shards: int) -> dict:
    """A job that never finishes by itself and whose assignments stay out for an hour."""
    return {
        "name": "dispatch-throughput-benchmark",
        "model": MODEL,
        "dataset": {"source": f"npz:{dataset}", "subsets": shards},
        "stop": {"target_accuracy": 1.0, "max_epochs": 1000},
        "scheduling": {"deadline_seconds": 3600},
    }


def insert_hosts(database_url: str, count: int) -> list[str]:
    """Register `count` hosts as rows in one transaction; returns their bearer tokens."""
    tokens = [secrets.token_urlsafe(32) for _ in range(count)]
    engine = create_engine(database_url)
    try:
        with Session(engine) as s, s.begin():
            s.execute(
                insert(Host),
                [{"name": f"bench-{i}", "token_hash": hash_token(t), "device": "cpu"} for i, t in enumerate(tokens)],
            )
    finally:
        engine.dispose()
    return tokens


# --- load --------------------------------------------------------------------------------------


@dataclass
class Window:
    """What completed between `start` and `end` (monotonic seconds)."""

    start: float
    end: float
    latencies: list[float] = field(default_factory=list)
    dispatches: int = 0
    empty: int = 0  # 200 answers without an assignment: the job ran out of ready workunits
    errors: int = 0  # answers other than 200
    transport_errors: int = 0  # no answer at all (refused, reset, timed out)
    status_codes: dict[int, int] = field(default_factory=dict)

    def contains(self, t: float) -> bool:
        return self.start <= t <= self.end


@dataclass
class Load:
    tokens: list[str]
    window: Window
    total: int = 0  # every completed request, warm-up included

    async def worker(self, http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        w = self.window
        while time.monotonic() < w.end:
            auth = {"Authorization": f"Bearer {rng.choice(self.tokens)}"}
            start = time.monotonic()
            try:
                resp = await http.post("/v1/work", json={"free_slots": 1}, headers=auth)
            except httpx.HTTPError:
                if w.contains(time.monotonic()):
                    w.transport_errors += 1
                await asyncio.sleep(0.1)
                continue
            done = time.monotonic()
            self.total += 1
            if not w.contains(done):
                continue
            w.latencies.append(done - start)
            if resp.status_code != 200:
                w.errors += 1
                w.status_codes[resp.status_code] = w.status_codes.get(resp.status_code, 0) + 1
                continue
            n = len(resp.json()["assignments"])
            w.dispatches += n
            w.empty += n == 0

    async def progress(self) -> None:
        w = self.window
        last_n, last_t = 0, time.monotonic()
        while time.monotonic() < w.end:
            await asyncio.sleep(PROGRESS_EVERY_S)
            now = time.monotonic()
            phase = "warm-up" if now < w.start else "measuring"
            log(
                f"{phase}: {(self.total - last_n) / (now - last_t):.0f} requests/s over the last "
                f"{now - last_t:.1f}s ({self.total} in all)"
            )
            last_n, last_t = self.total, now


async def drive(url: str, tokens: list[str], concurrency: int, warmup: float, seconds: float) -> Window:
    now = time.monotonic()
    load = Load(tokens, Window(start=now + warmup, end=now + warmup + seconds))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        await asyncio.gather(load.progress(), *(load.worker(http, i) for i in range(concurrency)))
    return load.window


# --- main --------------------------------------------------------------------------------------


def run(var_dir: Path, hosts: int, shards: int, concurrency: int, warmup: float, seconds: float) -> dict:
    dataset = var_dir / "bench.npz"
    write_dataset(dataset, shards)
    with fresh_postgres_database(admin_database_url()) as database_url:
        cluster = Cluster(
            var_dir=var_dir / "cluster",
            database_url=database_url,
            server_workers=SCHEDULER_WORKERS,
            assimilator_concurrency=1,
        )
        try:
            log(
                f"starting redis, the scheduler ({SCHEDULER_WORKERS} workers), the transitioner and one "
                "parameter server on PostgreSQL ..."
            )
            cluster.start()
            started = time.monotonic()
            # tens of thousands of shards are written one file each
            job = cluster.submit(job_spec(dataset, shards), timeout=900)
            log(f"job {job['job_id']}: {job['shards']:,} shards submitted in {time.monotonic() - started:.1f}s")
            started = time.monotonic()
            tokens = insert_hosts(database_url, hosts)
            log(f"{hosts:,} hosts inserted in {time.monotonic() - started:.1f}s")
            log(f"{concurrency} requests in flight: {warmup:.0f}s warm-up, then {seconds:.0f}s measured ...")
            window = asyncio.run(drive(cluster.url, tokens, concurrency, warmup, seconds))
        finally:
            log("stopping the cluster")
            cluster.stop()
    if window.status_codes:
        log(f"non-200 answers: {window.status_codes}")
    if window.empty:
        log(f"warning: {window.empty} answers carried no assignment (the job ran out of ready workunits)")
    return report(hosts, shards, concurrency, seconds, window)


def report(hosts: int, shards: int, concurrency: int, seconds: float, w: Window) -> dict:
    lat_ms = np.array(w.latencies or [float("nan")]) * 1000
    requests_per_s = len(w.latencies) / seconds
    return {
        "benchmark": "dispatch_throughput",
        "database": "postgresql",
        "scheduler_workers": SCHEDULER_WORKERS,
        "registered_hosts": hosts,
        "concurrency": concurrency,
        "seconds": seconds,
        "requests": len(w.latencies),
        "requests_per_s": round(requests_per_s, 1),
        "dispatches": w.dispatches,
        "dispatches_per_s": round(w.dispatches / seconds, 1),
        "p50_ms": round(float(np.percentile(lat_ms, 50)), 1),
        "p95_ms": round(float(np.percentile(lat_ms, 95)), 1),
        "errors": w.errors,
        "boinc_jobs_per_s": BOINC_JOBS_PER_S,
        "ratio_to_boinc": round(w.dispatches / seconds / BOINC_JOBS_PER_S, 2),
        "boinc_source": BOINC_CITATION,
        "transport_errors": w.transport_errors,
        "empty_replies": w.empty,
        "shards": shards,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds, after the warm-up")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before measuring")
    parser.add_argument("--concurrency", type=int, default=64, help="work requests in flight at once")
    parser.add_argument("--hosts", type=int, default=10_000, help="registered hosts")
    parser.add_argument(
        "--shards",
        type=int,
        default=20_000,
        help="one-example shards of the job (epoch 1 and 2 together hold twice as many workunits)",
    )
    args = parser.parse_args()
    if args.seconds <= 0 or args.warmup < 0 or args.concurrency < 1 or args.hosts < 1 or args.shards < 1:
        parser.error("--seconds, --concurrency, --hosts and --shards must be positive, --warmup not negative")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-bench-") as tmp:
        figures = run(Path(tmp), args.hosts, args.shards, args.concurrency, args.warmup, args.seconds)
    figures["wall_s"] = round(time.monotonic() - started, 1)
    log(BOINC_CITATION)
    log(
        f"ours: {figures['dispatches_per_s']} dispatches/s ({figures['requests_per_s']} requests/s), "
        f"p50 {figures['p50_ms']} ms, p95 {figures['p95_ms']} ms: {figures['ratio_to_boinc']}x BOINC's rate"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
