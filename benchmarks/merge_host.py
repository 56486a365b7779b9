"""The host that benchmarks/merge_latency.py plays over HTTP: it registers, takes assignments and
uploads a perturbed copy of W_s for each, and reads what the merges recorded (the Redis merge log,
the scheduler's merge count). Not a benchmark of its own: merge_latency.py imports it."""

import json
import time
from collections.abc import Callable

import httpx
import numpy as np
import redis

from crowdtrain.core import keys
from crowdtrain.core.tensors import Params, decode, encode, views
from crowdtrain.launch.cluster import Cluster

EXAMPLES_PER_SHARD = 2
MERGE_TIMEOUT_S = 60.0
POLL_S = 0.002


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


def variant(body: bytes, i: int) -> bytes:
    """`body` with one value of its first floating-point tensor moved by `i` steps: other weights, so
    that no upload is refused as a replay of another."""
    out = bytearray(body)
    first = next(a for a in views(out).values() if a.dtype.kind == "f" and a.size)
    first.reshape(-1)[0] += np.asarray(1e-3 * (i + 1), first.dtype)
    return bytes(out)


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


def wait_until(
    condition: Callable[[], bool], what: str, cluster: Cluster, timeout: float = MERGE_TIMEOUT_S, poll: float = POLL_S
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout}s\n{cluster.service('assimilator').tail()}")
        time.sleep(poll)


def merge_entry(r: redis.Redis, job_id: int, assignment_id: int) -> dict | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else json.loads(raw)


def merges_recorded(cluster: Cluster, job_id: int) -> int:
    """Merges the scheduler's database has recorded (the task's bookkeeping after the Redis commit)."""
    with cluster.admin() as admin:
        return check(admin.get(f"/v1/jobs/{job_id}"))["merges"]


def take_assignments(host: httpx.Client, n: int) -> list[dict]:
    taken: list[dict] = []
    while len(taken) < n:
        given = check(host.post("/v1/work", json={"free_slots": min(256, n - len(taken))}))["assignments"]
        if not given:
            raise RuntimeError(f"the scheduler gave {len(taken)} of {n} assignments")
        taken += given
    return taken
