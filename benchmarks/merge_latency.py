"""Merge latency of one VC-ASGD update of a ~5M-parameter model, against raw Redis GET+SET.

What it measures
    The time from "upload received" by the scheduler to "W_s updated in Redis" for one merge of
    the zoo's `resnet` with `{width: 86, blocks: 2}` (5.01M parameters, float32, ~20 MB). The
    span covers the upload's validation and storage write, the database updates, the Celery
    hand-off, reading the upload back, decoding, the merge math, encoding and the SET of W_s.

    Both ends come from the Redis hash `keys.merge_log(job_id)` (assignment id -> JSON
    {version, received_at, merged_at}): `received_at` is taken when the upload handler starts,
    `merged_at` right after the MULTI/EXEC that wrote W_s: that gives `merge_p50_s`/`merge_p95_s`.
    As a cross-check this script also notes when it first sees the entry, which is written in the
    same transaction as W_s (polled every few ms): `observed_p50_s`/`observed_p95_s`.

    As the baseline, the same run times a plain Redis GET + SET of the same bytes (the encoded
    W_s) against the same private Redis.

How
    A real `Cluster` (SQLite, private redis-server, local storage, scheduler, transitioner, one
    Celery parameter server) runs in a temporary directory. No client processes: this script is
    the host. It registers over HTTP, submits a job on a small random npz, takes one assignment at
    a time, uploads a slightly perturbed copy of W_s v0, and waits until the scheduler reports that
    merge recorded before the next upload, so every merge is measured in isolation.
    The first samples are warm-up and are not counted.

Run
    .venv/bin/python benchmarks/merge_latency.py [--samples N]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import redis

from crowdtrain.core import keys
from crowdtrain.core.tensors import Params, decode, encode
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger import paramstore

MODEL = {"name": "resnet", "options": {"width": 86, "blocks": 2}}
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
EXAMPLES_PER_SHARD = 2
VALIDATION_EXAMPLES = 8
WARMUP = 2
MERGE_TIMEOUT_S = 60.0
POLL_S = 0.002
PAPER_SECONDS_PER_UPDATE = 0.87  # VC-ASGD paper, 4.97M-parameter network
GOAL_S = 0.1


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


def check(resp: httpx.Response) -> dict:
    if resp.status_code >= 400:
        raise RuntimeError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
    return resp.json()


def register_host(cluster: Cluster) -> httpx.Client:
    """Register as a host; returns an HTTP client that authenticates with the host token."""
    reply = check(
        httpx.post(
            f"{cluster.url}/v1/hosts",
            timeout=30,
            json={"join_token": cluster.join_token, "name": "merge-latency-bench"},
        )
    )
    return httpx.Client(base_url=cluster.url, timeout=120, headers={"Authorization": f"Bearer {reply['host_token']}"})


def perturbed(params: Params, scale: float = 1e-3, seed: int = 1) -> Params:
    """W_s with small noise on every float tensor: a plausible client result."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, arr in params.items():
        if arr.dtype.kind == "f":
            arr = arr + rng.standard_normal(arr.shape).astype(arr.dtype) * np.asarray(scale, arr.dtype)
        out[name] = arr
    return out


def client_result(snapshot: bytes) -> bytes:
    """What a client would upload: the snapshot, slightly changed."""
    return encode(perturbed(decode(snapshot)))


# --- one merge ---------------------------------------------------------------------------------


def take_assignment(host: httpx.Client) -> dict:
    assignments = check(host.post("/v1/work", json={"free_slots": 1}))["assignments"]
    if not assignments:
        raise RuntimeError("the scheduler gave no assignment; the epoch ran out of workunits")
    return assignments[0]


def upload(host: httpx.Client, assignment_id: int, body: bytes) -> None:
    check(
        host.put(
            f"/v1/assignments/{assignment_id}/result",
            content=body,
            params={"train_loss": 1.0, "examples": EXAMPLES_PER_SHARD, "seconds": 0.1},
            headers={"Content-Type": "application/octet-stream"},
        )
    )


def wait_until(condition: Callable[[], bool], what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + MERGE_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {MERGE_TIMEOUT_S}s\n{cluster.service('assimilator').tail()}")
        time.sleep(POLL_S)


def merge_entry(r: redis.Redis, job_id: int, assignment_id: int) -> dict | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else json.loads(raw)


def merges_recorded(cluster: Cluster, job_id: int) -> int:
    """Merges the scheduler's database has recorded (the task's bookkeeping after the Redis commit)."""
    with cluster.admin() as admin:
        return check(admin.get(f"/v1/jobs/{job_id}"))["merges"]


@dataclass(frozen=True)
class MergeTiming:
    logged_s: float  # received_at -> merged_at, as the merge task recorded it
    observed_s: float  # received_at -> the committed merge-log entry was first seen in Redis


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
    return MergeTiming(entry["merged_at"] - entry["received_at"], seen_at - entry["received_at"])


def measure_merges(
    cluster: Cluster, host: httpx.Client, r: redis.Redis, job_id: int, first_assignment: int, body: bytes, samples: int
) -> list[MergeTiming]:
    timings = []
    for i in range(WARMUP + samples):
        assignment_id = first_assignment if i == 0 else take_assignment(host)["assignment_id"]
        timing = measure_merge(cluster, host, r, job_id, assignment_id, body)
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


# --- main --------------------------------------------------------------------------------------


def run(samples: int, var_dir: Path) -> dict:
    shards = WARMUP + samples
    dataset = var_dir / "bench.npz"
    write_dataset(dataset, shards)
    cluster = Cluster(var_dir=var_dir / "cluster", assimilator_concurrency=1)
    try:
        log("starting redis, scheduler, transitioner and one parameter server ...")
        cluster.start()
        r = paramstore.connect(cluster.redis_url)
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
        _, blob = paramstore.read_blob(r, job_id)
        log(f"measuring {WARMUP} + {samples} raw Redis GET+SET of {len(blob):,} bytes ...")
        raw = measure_raw_redis(r, blob, samples)
    finally:
        log("stopping the cluster")
        cluster.stop()
    return report(job["parameters"], len(blob), merges, raw)


def report(parameters: int, size: int, merges: list[MergeTiming], raw: list[float]) -> dict:
    merge_p50, merge_p95 = percentiles([m.logged_s for m in merges])
    seen_p50, seen_p95 = percentiles([m.observed_s for m in merges])
    raw_p50, raw_p95 = percentiles(raw)
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
    args = parser.parse_args()
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crowdtrain-bench-") as tmp:
        figures = run(args.samples, Path(tmp))
    figures["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
