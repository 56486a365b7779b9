"""Merge latency of one VC-ASGD update of a ~5M-parameter model, against raw Redis GET+SET.

What it measures
    The time from "upload received" by the scheduler to "W_s updated in Redis" for one merge of
    the zoo's `resnet` with `{width: 86, blocks: 2}` (5.01M parameters, float32, ~20 MB). The
    span covers the upload's validation and storage write, the database updates, the Celery
    hand-off, reading the upload back, decoding, the merge math, encoding and the SET of W_s.

    Both ends come from the Redis hash `keys.merge_log(job_id)` (assignment id -> JSON
    {version, merged_at, received_at}): `received_at` is taken when the upload handler starts.
    The entry is written in the same MULTI/EXEC as W_s, so the moment this script first sees it
    (polled every few ms) is when W_s was updated: that gives `merge_p50_s`/`merge_p95_s`.
    `merged_at` as recorded is also reported (`merge_log_*`); paramstore.merge_once takes it
    before encoding and SETting W_s, so it reads low by that much.

    As the baseline, the same run times a plain Redis GET + SET of the same bytes (the encoded
    W_s) against the same private Redis.

How
    A real `Cluster` (SQLite, private redis-server, local storage, scheduler, transitioner, one
    Celery parameter server) runs in a temporary directory. No client processes: this script is
    the host. It registers over HTTP, submits a job on a small random npz, takes one assignment at
    a time, uploads a slightly perturbed copy of W_s v0, and waits for that merge to land and the
    parameter server to go idle before the next upload, so every merge is measured in isolation.
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
from safetensors.numpy import save as safetensors_save

from assimilator import paramstore
from crowdtrain import keys
from crowdtrain.launch import Cluster
from crowdtrain.tensors import Params, decode
from crowdtrain.zoo import build_model

MODEL = {"name": "resnet", "options": {"width": 86, "blocks": 2}}
IMAGE_SHAPE = (3, 32, 32)  # channels first: the zoo's resnet reads NHWC input_shape wrongly (see report)
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
    np.savez(path,
             x=rng.standard_normal((n, *IMAGE_SHAPE), dtype=np.float32),
             y=np.arange(n, dtype=np.int64) % NUM_CLASSES,
             x_val=rng.standard_normal((VALIDATION_EXAMPLES, *IMAGE_SHAPE), dtype=np.float32),
             y_val=np.arange(VALIDATION_EXAMPLES, dtype=np.int64) % NUM_CLASSES)


def job_spec(dataset: Path, shards: int) -> dict:
    """One epoch holds every sample; no validation, snapshot or epoch end gets in the way."""
    return {
        "name": "merge-latency-benchmark",
        "model": MODEL,
        "dataset": {"source": f"npz:{dataset}", "subsets": shards},
        "stop": {"target_accuracy": 1.0, "max_epochs": 1000},
        "scheduling": {"deadline_seconds": 600, "eval_every": 100_000,
                       "snapshot_every_merges": 100_000, "snapshot_every_seconds": 1e9},
    }


def check(resp: httpx.Response) -> dict:
    if resp.status_code >= 400:
        raise RuntimeError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text}")
    return resp.json()


def submit_job(cluster: Cluster, spec: dict) -> dict:
    with cluster.admin() as admin:
        return check(admin.post("/v1/jobs", json=spec))


def register_host(cluster: Cluster) -> httpx.Client:
    """Register as a host; returns an HTTP client that authenticates with the host token."""
    reply = check(httpx.post(f"{cluster.url}/v1/hosts", timeout=30,
                             json={"join_token": cluster.join_token, "name": "merge-latency-bench"}))
    return httpx.Client(base_url=cluster.url, timeout=120,
                        headers={"Authorization": f"Bearer {reply['host_token']}"})


def perturbed(params: Params, scale: float = 1e-3, seed: int = 1) -> Params:
    """W_s with small noise on every float tensor: a plausible client result."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, arr in params.items():
        if arr.dtype.kind == "f":
            arr = arr + rng.standard_normal(arr.shape).astype(arr.dtype) * np.asarray(scale, arr.dtype)
        out[name] = arr
    return out


def model_shapes(recipe: dict) -> dict[str, tuple[int, ...]]:
    m = recipe["model"]
    model = build_model(m["name"], m["input_shape"], m["num_classes"], **m["options"])
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def client_result(snapshot: bytes, recipe: dict) -> bytes:
    """What a client would upload: the snapshot, slightly changed, in the model's own shapes.

    `crowdtrain.tensors.encode` stores 0-d tensors (BatchNorm's `num_batches_tracked`) as shape
    [1] (np.ascontiguousarray), so the snapshot has them as [1] and the upload check, which
    expects [], would refuse them; the result is therefore reshaped and saved with safetensors.
    """
    shapes = model_shapes(recipe)
    params = {name: arr.reshape(shapes[name]) for name, arr in perturbed(decode(snapshot)).items()}
    return safetensors_save(params)


# --- one merge ---------------------------------------------------------------------------------

def take_assignment(host: httpx.Client) -> dict:
    assignments = check(host.post("/v1/work", json={"free_slots": 1}))["assignments"]
    if not assignments:
        raise RuntimeError("the scheduler gave no assignment; the epoch ran out of workunits")
    return assignments[0]


def upload(host: httpx.Client, assignment_id: int, body: bytes) -> None:
    check(host.put(f"/v1/assignments/{assignment_id}/result", content=body,
                   params={"train_loss": 1.0, "examples": EXAMPLES_PER_SHARD, "seconds": 0.1},
                   headers={"Content-Type": "application/octet-stream"}))


def wait_until(condition: Callable[[], bool], what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + MERGE_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {MERGE_TIMEOUT_S}s\n{cluster.service('assimilator').tail()}")
        time.sleep(POLL_S)


def merge_entry(r: redis.Redis, job_id: int, assignment_id: int) -> dict | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else json.loads(raw)


def broker_idle(r: redis.Redis) -> bool:
    """No merge queued and none running: with late acks a task stays in kombu's `unacked` hash
    until it has returned, so this also waits for the bookkeeping after the Redis commit."""
    return r.llen(keys.ASSIMILATE_QUEUE) == 0 and r.hlen("unacked") == 0


@dataclass(frozen=True)
class MergeTiming:
    observed_s: float  # received_at -> the committed merge-log entry was first seen in Redis
    logged_s: float  # received_at -> merged_at, as the merge task recorded it


def measure_merge(cluster: Cluster, host: httpx.Client, r: redis.Redis, job_id: int, assignment_id: int,
                  body: bytes) -> MergeTiming:
    """Upload in a thread while polling the merge log, so the commit is seen within POLL_S.

    The log entry is written in the same MULTI/EXEC as W_s, so its first sighting is when W_s was
    updated. `merged_at` itself is taken before the encode and the SET (paramstore.merge_once),
    which is why both figures are kept.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        put = pool.submit(upload, host, assignment_id, body)

        def merged_or_refused() -> bool:
            return (put.done() and put.exception() is not None) or merge_entry(r, job_id, assignment_id) is not None

        wait_until(merged_or_refused, f"assignment {assignment_id} was not merged", cluster)
        seen_at = time.time()
        put.result()  # raises if the upload was refused
    entry = merge_entry(r, job_id, assignment_id)
    wait_until(lambda: broker_idle(r), "the parameter server did not go idle", cluster)
    return MergeTiming(seen_at - entry["received_at"], entry["merged_at"] - entry["received_at"])


def measure_merges(cluster: Cluster, host: httpx.Client, r: redis.Redis, job_id: int, first_assignment: int,
                   body: bytes, samples: int) -> list[MergeTiming]:
    timings = []
    for i in range(WARMUP + samples):
        assignment_id = first_assignment if i == 0 else take_assignment(host)["assignment_id"]
        timing = measure_merge(cluster, host, r, job_id, assignment_id, body)
        label = "warm-up" if i < WARMUP else f"sample {i - WARMUP + 1}/{samples}"
        log(f"{label}: merge {timing.observed_s * 1000:.1f} ms (merge log says {timing.logged_s * 1000:.1f} ms)")
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
        job = submit_job(cluster, job_spec(dataset, shards))
        job_id = job["job_id"]
        log(f"job {job_id}: {job['parameters']:,} parameters, {job['shards']} shards")
        with register_host(cluster) as host:
            first = take_assignment(host)
            w0 = host.get(first["snapshot"]["url"])
            w0.raise_for_status()
            body = client_result(w0.content, first["recipe"])
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
    merge_p50, merge_p95 = percentiles([m.observed_s for m in merges])
    logged_p50, logged_p95 = percentiles([m.logged_s for m in merges])
    raw_p50, raw_p95 = percentiles(raw)
    return {
        "benchmark": "merge_latency",
        "model": MODEL,
        "parameters": parameters,
        "bytes": size,
        "samples": len(merges),
        "merge_p50_s": round(merge_p50, 4),
        "merge_p95_s": round(merge_p95, 4),
        "merge_log_p50_s": round(logged_p50, 4),
        "merge_log_p95_s": round(logged_p95, 4),
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
