"""Merge latency and throughput of VC-ASGD updates of a ~5M-parameter model, against the Redis floor.

What it measures
    The time from "upload received" by the scheduler (its body in hand, before it is checked) to
    "W_s updated in Redis" for one merge of the zoo's `resnet` with `{width: 86, blocks: 2}` (5.01M
    parameters, float32, ~20 MB). The span covers the upload's check and digest, its storage write,
    the database updates, the Celery hand-off, the parameter server's one read of the upload, the
    merge math and the MULTI/EXEC that writes W_s.

    Both ends come from the Redis hash `keys.merge_log(job_id)` (assignment id -> JSON
    {version, received_at, merged_at}): `received_at` is taken when the upload's body is in hand,
    `merged_at` right after the MULTI/EXEC that wrote W_s: that gives `merge_p50_s`/`merge_p95_s`.
    As a cross-check this script also notes when it first sees the entry, which is written in the
    same transaction as W_s (polled every few ms): `observed_p50_s`/`observed_p95_s`.

    The floor, timed in the same run against the same Redis: W_s's bytes written as the parameter
    store writes them, 1 MB chunks in one MULTI/EXEC (`floor_p50_s`, `floor_ratio_p50` = merge p50 /
    floor p50, goal <= 3). Where the rest goes: each stage's span from the stamps the merge log
    keeps (crowdtrain.core.merge_stages), p50 in milliseconds (`stages_p50_ms`) and over the
    floor's p50 (`stages_over_floor_p50`). A plain GET + SET of the same bytes as one value is kept for comparison
    (`redis_get_set_*`, `ratio_p50`); it is not a floor.

    Throughput: for P = 1, 2 and 4 parameter-server processes (`--concurrency P` of one Celery
    worker) and for one and two jobs (`--jobs`), a fresh cluster queues `--backlog` uploads of each
    job while its parameter server is stopped, then starts it and times the merges draining the
    queues: the merges after the first commit over the time from it to the last one
    (`merges_per_s`; (merges - 1) / (last merged_at - first) when each commit holds one merge).
    `speedup_p2` is P=2's rate over P=1's with one job, `speedup_p2_2_jobs` with two: more parameter
    servers must serve more jobs faster and never slow one job down. Every process of the cluster and
    this script share the machine's cores (`load_average` says how busy the machine was).

How
    A real `Cluster` (SQLite, private redis-server, local storage, scheduler, transitioner, Celery
    parameter servers) runs in a temporary directory. No client processes: this script is the host.
    It registers over HTTP, submits a job on a small random npz, takes assignments and uploads a
    slightly perturbed copy of W_s v0, changed in one value for each upload (the same weights
    twice would be refused as a replay). For the latency it waits until the scheduler reports each
    merge recorded before the next upload, so every merge is measured in isolation; the first
    samples are warm-up and are not counted. What the host does over HTTP is in merge_host.py.

Run
    .venv/bin/python benchmarks/merge_latency.py [--samples N] [--backlog N] [--processes 1 2 4] [--jobs 1 2]
        [--no-latency]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import redis

from crowdtrain.core import keys, merge_stages
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.paramstore import store
from merge_host import (
    EXAMPLES_PER_SHARD,
    client_result,
    merge_entry,
    merges_recorded,
    register_host,
    take_assignment,
    take_assignments,
    upload,
    variant,
    wait_until,
)

MODEL = {"name": "resnet", "options": {"width": 86, "blocks": 2}}
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
VALIDATION_EXAMPLES = 8
WARMUP = 2
DRAIN_POLL_S = 0.5  # while the throughput runs drain their backlog
PAPER_SECONDS_PER_UPDATE = 0.87  # VC-ASGD paper, 4.97M-parameter network
GOAL_S = 0.1
FLOOR_RATIO_GOAL = 3.0


def log(message: str) -> None:
    print(f"[merge_latency] {message}", file=sys.stderr, flush=True)


def percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 95))


# --- setup -------------------------------------------------------------------------------------


def write_dataset(path: Path, shards: int, seed: int = 0) -> None:
    """Random images, `EXAMPLES_PER_SHARD` per shard, plus a tiny validation split."""
    rng = np.random.default_rng(seed)
    n = shards * EXAMPLES_PER_SHARD
    np.savez(
        path,
        x=rng.standard_normal((n, *IMAGE_SHAPE), dtype=np.float32),
        y=np.arange(n, dtype=np.int64) % NUM_CLASSES,
        x_val=rng.standard_normal((VALIDATION_EXAMPLES, *IMAGE_SHAPE), dtype=np.float32),
        y_val=np.arange(VALIDATION_EXAMPLES, dtype=np.int64) % NUM_CLASSES,
    )


def job_spec(dataset: Path, shards: int) -> dict:
    """One epoch holds every sample; no validation, snapshot or epoch end gets in the way."""
    return {
        "name": "merge-latency-benchmark",
        "model": MODEL,
        "dataset": {"source": f"npz:{dataset}", "subsets": shards},
        "stop": {"target_accuracy": 1.0, "max_epochs": 1000},
        "scheduling": {
            "deadline_seconds": 600,
            "eval_every": 100_000,
            "snapshot_every_merges": 100_000,
            "snapshot_every_seconds": 1e9,
        },
    }


# --- one merge ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeTiming:
    logged_s: float  # received_at -> merged_at, as the merge task recorded it
    observed_s: float  # received_at -> the committed merge-log entry was first seen in Redis
    stages_s: dict[str, float]  # each stage's span (crowdtrain.core.merge_stages.spans)


def measure_merge(
    cluster: Cluster, host: httpx.Client, r: redis.Redis, job_id: int, assignment_id: int, body: bytes
) -> MergeTiming:
    """Upload in a thread while polling the merge log, so the commit is seen within POLL_S.

    The log entry is written in the same MULTI/EXEC as W_s, so its first sighting bounds
    `merged_at` from above.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        put = pool.submit(upload, host, assignment_id, body)

        def merged_or_refused() -> bool:
            return (put.done() and put.exception() is not None) or merge_entry(r, job_id, assignment_id) is not None

        wait_until(merged_or_refused, f"assignment {assignment_id} was not merged", cluster)
        seen_at = time.time()
        put.result()  # raises if the upload was refused
    wait_until(lambda: "merged_at" in merge_entry(r, job_id, assignment_id), "merged_at was not logged", cluster)
    entry = merge_entry(r, job_id, assignment_id)
    wait_until(lambda: merges_recorded(cluster, job_id) >= entry["version"], "the merge was not recorded", cluster)
    return MergeTiming(
        entry["merged_at"] - entry["received_at"],
        seen_at - entry["received_at"],
        merge_stages.spans(entry.get("stamps", {})),
    )


def measure_merges(
    cluster: Cluster, host: httpx.Client, r: redis.Redis, job_id: int, first_assignment: int, body: bytes, samples: int
) -> list[MergeTiming]:
    timings = []
    for i in range(WARMUP + samples):
        assignment_id = first_assignment if i == 0 else take_assignment(host)["assignment_id"]
        timing = measure_merge(cluster, host, r, job_id, assignment_id, variant(body, i))
        label = "warm-up" if i < WARMUP else f"sample {i - WARMUP + 1}/{samples}"
        log(f"{label}: merge {timing.logged_s * 1000:.1f} ms (first seen after {timing.observed_s * 1000:.1f} ms)")
        if i >= WARMUP:
            timings.append(timing)
    return timings


# --- baseline ----------------------------------------------------------------------------------


def measure_raw_redis(r: redis.Redis, blob: bytes, repetitions: int) -> list[float]:
    """GET + SET of `blob` on a scratch key: the floor for reading and writing W_s once."""
    key = f"{keys.PREFIX}:bench:raw"
    r.set(key, blob)
    timings = []
    try:
        for _ in range(WARMUP + repetitions):
            start = time.perf_counter()
            r.get(key)
            r.set(key, blob)
            timings.append(time.perf_counter() - start)
    finally:
        r.delete(key)
    return timings[WARMUP:]


def measure_chunked_write(r: redis.Redis, blob: bytes, repetitions: int) -> list[float]:
    """`blob` written as the parameter store writes W_s (1 MB chunks, one MULTI/EXEC) on scratch keys:
    the floor of a merge, which must write W_s once."""
    scratch_job = 10**9
    timings = []
    try:
        for _ in range(WARMUP + repetitions):
            start = time.perf_counter()
            with r.pipeline(transaction=True) as pipe:
                store.queue_blob_write(pipe, scratch_job, blob)
                pipe.execute()
            timings.append(time.perf_counter() - start)
    finally:
        r.delete(*(keys.params_chunk(scratch_job, i) for i in range(-(-len(blob) // store.CHUNK_BYTES))))
    return timings[WARMUP:]


# --- throughput ----------------------------------------------------------------------------------


def drain_rate(merged_at: list[float]) -> float:
    """Merges per second after the first commit: (merges - those of the first commit) / (last - first).

    A parameter server that merges a job's queue in one pass commits several merges with one
    `merged_at`; counting from the end of the first commit keeps the figure that of one-at-a-time
    merges, (merges - 1) / (last - first), when every commit holds one."""
    first, last = merged_at[0], merged_at[-1]
    if last <= first:
        raise RuntimeError(f"all {len(merged_at)} merges landed in one commit: raise --backlog")
    return (len(merged_at) - merged_at.count(first)) / (last - first)


def measure_throughput(processes: int, jobs: int, backlog: int, var_dir: Path) -> dict:
    """Merges per second of `processes` parameter-server processes draining `backlog` queued uploads of
    each of `jobs` jobs (queued in turn, one of each job after another). Each job has one shard more
    than it uploads, so that no epoch ends (and is evaluated) while the queues drain."""
    dataset = var_dir / "throughput.npz"
    write_dataset(dataset, backlog + 1)
    cluster = Cluster(var_dir=var_dir / f"cluster-p{processes}-j{jobs}", assimilator_concurrency=processes)
    try:
        cluster.start()
        r = store.connect(cluster.redis_url)
        job_ids = [cluster.submit(job_spec(dataset, backlog + 1))["job_id"] for _ in range(jobs)]
        assimilator = cluster.service("assimilator")
        with register_host(cluster) as host:
            given = take_assignments(host, jobs * (backlog + 1))
            taken = [[a for a in given if a["job_id"] == job_id][:backlog] for job_id in job_ids]
            if any(len(assignments) < backlog for assignments in taken):
                raise RuntimeError(
                    f"the scheduler gave {[len(a) for a in taken]} assignments of the jobs, not {backlog}"
                )
            snapshot = host.get(taken[0][0]["snapshot"]["url"])
            snapshot.raise_for_status()
            body = client_result(snapshot.content)
            assimilator.stop(timeout=60)  # the uploads queue up while no parameter server runs
            for i in range(backlog):
                for j, assignments in enumerate(taken):  # no two uploads alike, or one is refused as a replay
                    upload(host, assignments[i]["assignment_id"], variant(body, 10_000 + i * jobs + j))
            log(f"P={processes}, {jobs} job(s): {jobs} x {backlog} uploads queued; starting the parameter server")
            assimilator.start()
            # Polled slowly: the rate comes from the merge log's timestamps, and each poll is a request
            # that the scheduler serves on the cores the parameter servers are measured on.
            for job_id in job_ids:
                wait_until(
                    lambda job_id=job_id: merges_recorded(cluster, job_id) >= backlog,
                    f"{backlog} merges of job {job_id}",
                    cluster,
                    600,
                    DRAIN_POLL_S,
                )
        per_job = {
            job_id: sorted(json.loads(v)["merged_at"] for v in r.hvals(keys.merge_log(job_id))) for job_id in job_ids
        }
    finally:
        cluster.stop()
    merged_at = sorted(t for times in per_job.values() for t in times)
    for job_id, times in per_job.items():
        log(f"  job {job_id}: merged from +{times[0] - merged_at[0]:.2f}s to +{times[-1] - merged_at[0]:.2f}s")
    rate = drain_rate(merged_at)
    log(f"P={processes}, {jobs} job(s): {len(merged_at)} merges, {rate:.1f} merges/s")
    return {"processes": processes, "jobs": jobs, "merges": len(merged_at), "merges_per_s": round(rate, 2)}


# --- main --------------------------------------------------------------------------------------


def run(samples: int, var_dir: Path) -> dict:
    shards = WARMUP + samples
    dataset = var_dir / "bench.npz"
    write_dataset(dataset, shards)
    cluster = Cluster(var_dir=var_dir / "cluster", assimilator_concurrency=1)
    try:
        log("starting redis, scheduler, transitioner and one parameter server ...")
        cluster.start()
        r = store.connect(cluster.redis_url)
        job = cluster.submit(job_spec(dataset, shards))
        job_id = job["job_id"]
        log(f"job {job_id}: {job['parameters']:,} parameters, {job['shards']} shards")
        with register_host(cluster) as host:
            first = take_assignment(host)
            w0 = host.get(first["snapshot"]["url"])
            w0.raise_for_status()
            body = client_result(w0.content)
            log(f"W_s v0 is {len(w0.content):,} bytes; measuring {WARMUP} + {samples} merges ...")
            merges = measure_merges(cluster, host, r, job_id, first["assignment_id"], body, samples)
        _, blob = store.read_blob(r, job_id)
        log(f"measuring {WARMUP} + {samples} chunked MULTI/EXEC writes of {len(blob):,} bytes (the floor) ...")
        floor = measure_chunked_write(r, blob, samples)
        log(f"measuring {WARMUP} + {samples} raw Redis GET+SET of {len(blob):,} bytes ...")
        raw = measure_raw_redis(r, blob, samples)
    finally:
        log("stopping the cluster")
        cluster.stop()
    return report(job["parameters"], len(blob), merges, floor, raw)


def report(parameters: int, size: int, merges: list[MergeTiming], floor: list[float], raw: list[float]) -> dict:
    merge_p50, merge_p95 = percentiles([m.logged_s for m in merges])
    seen_p50, seen_p95 = percentiles([m.observed_s for m in merges])
    floor_p50, floor_p95 = percentiles(floor)
    raw_p50, raw_p95 = percentiles(raw)
    stages = {
        stage: float(np.percentile([m.stages_s[stage] for m in merges if stage in m.stages_s], 50))
        for stage in merge_stages.STAGES
        if any(stage in m.stages_s for m in merges)
    }
    return {
        "benchmark": "merge_latency",
        "model": MODEL,
        "parameters": parameters,
        "bytes": size,
        "samples": len(merges),
        "merge_p50_s": round(merge_p50, 4),
        "merge_p95_s": round(merge_p95, 4),
        "observed_p50_s": round(seen_p50, 4),
        "observed_p95_s": round(seen_p95, 4),
        "floor_p50_s": round(floor_p50, 4),
        "floor_p95_s": round(floor_p95, 4),
        "floor_ratio_p50": round(merge_p50 / floor_p50, 2),
        "floor_ratio_goal": FLOOR_RATIO_GOAL,
        "stages_p50_ms": {stage: round(s * 1000, 2) for stage, s in stages.items()},
        "stages_over_floor_p50": {stage: round(s / floor_p50, 2) for stage, s in stages.items()},
        "redis_get_set_p50_s": round(raw_p50, 4),
        "redis_get_set_p95_s": round(raw_p95, 4),
        "ratio_p50": round(merge_p50 / raw_p50, 2),
        "paper_seconds_per_update": PAPER_SECONDS_PER_UPDATE,
        "goal_s": GOAL_S,
        "meets_goal": merge_p50 < GOAL_S,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=30, help=f"measured merges, after {WARMUP} warm-up ones")
    parser.add_argument("--backlog", type=int, default=40, help="queued uploads each throughput run drains")
    parser.add_argument("--processes", type=int, nargs="*", default=[1, 2, 4], help="parameter servers per run")
    parser.add_argument("--jobs", type=int, nargs="*", default=[1, 2], help="jobs whose queues each run drains")
    parser.add_argument("--no-latency", action="store_true", help="measure the throughput runs only")
    args = parser.parse_args()
    if args.samples < 1 or args.backlog < 2:
        parser.error("--samples must be at least 1 and --backlog at least 2")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-bench-") as tmp:
        figures = {"benchmark": "merge_latency"} if args.no_latency else run(args.samples, Path(tmp))
        throughput = [measure_throughput(p, j, args.backlog, Path(tmp)) for j in args.jobs for p in args.processes]
    figures["throughput"] = throughput
    for jobs in args.jobs:
        rates = {t["processes"]: t["merges_per_s"] for t in throughput if t["jobs"] == jobs}
        if 1 in rates and 2 in rates:
            figures["speedup_p2" if jobs == 1 else f"speedup_p2_{jobs}_jobs"] = round(rates[2] / rates[1], 2)
    figures["cpu_cores"] = os.cpu_count()
    figures["load_average"] = os.getloadavg()
    figures["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
