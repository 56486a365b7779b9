"""Driving a DeDLOC job on a real cluster, for the end-to-end tests: its spec, its peer processes, and
what the scheduler recorded of it (commits, digests, stored states, the peers' traces and logs)."""

import json
import time

import numpy as np
import pytest

from crowdtrain.core import dedloc
from crowdtrain.core.tensors import decode
from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv

JOB_TIMEOUT = 300


def dedloc_spec(max_steps: int, target_accuracy: float = 0.99, **fields) -> dict:
    return {
        "name": "dedloc-test",
        "mode": "dedloc",
        "seed": 3,
        "model": {"name": "cnn1d", "options": {"channels": 16, "kernel_size": 5, "layers": 2}},
        "dataset": {"source": "builtin:mnist1d", "subsets": 4},
        "stop": {"target_accuracy": target_accuracy, "max_steps": max_steps},
        "dedloc": {
            "target_batch_size": 96,
            "micro_batch_size": 16,
            "optimizer": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "matchmaking_timeout": 4,
            "averaging_timeout": 20,
            "report_interval": 0.2,
        }
        | fields,
    }


def submit(cluster: Cluster, spec: dict) -> int:
    with cluster.admin() as http:
        resp = http.post("/v1/jobs", json=spec)
        assert resp.status_code == 201, resp.text
        return resp.json()["job_id"]


def start_peer(cluster: Cluster, job_id: int, name: str, *extra: str) -> Service:
    argv = crowdtrain_argv(
        "peer",
        "--server",
        cluster.url,
        "--job",
        str(job_id),
        "--name",
        name,
        "--threads",
        "1",
        "--trace",
        str(cluster.var_dir / f"{name}.trace"),
        *extra,
    )
    svc = Service(name, argv, cluster.client_env, cluster.var_dir / "logs" / f"{name}.log").start()
    cluster.clients.append(svc)
    return svc


def start_peers(
    cluster: Cluster, job_id: int, count: int, *common: str, only: dict[int, tuple[str, ...]] | None = None
) -> list[Service]:
    """Peers peer-0 .. peer-(count-1), peer i training data rank i of 3, each with the arguments
    `common` and peer i with `only[i]` after them."""
    only = only or {}
    return [
        start_peer(cluster, job_id, f"peer-{i}", "--data-rank", str(i), "--data-world", "3", *common, *only.get(i, ()))
        for i in range(count)
    ]


def wait_finished(cluster: Cluster, job_id: int, peers: list[Service], timeout: float = JOB_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    with cluster.admin() as http:
        while time.monotonic() < deadline:
            st = http.get(f"/v1/jobs/{job_id}").json()
            if st["status"] in ("succeeded", "failed", "cancelled"):
                # The job ends with the first upload of its final state; the other members still
                # apply that step (and write its trace line) before they learn that it has ended.
                for p in peers:
                    if p.alive:
                        p.proc.wait(timeout=120)
                return st
            assert any(p.alive for p in peers), "every peer exited:\n" + "\n".join(p.tail() for p in peers)
            time.sleep(0.5)
    pytest.fail(f"job {job_id} did not finish within {timeout}s: {st}\n" + "\n".join(p.tail(15) for p in peers))


def traces(cluster: Cluster) -> list[dict]:
    return [json.loads(line) for f in sorted(cluster.var_dir.glob("*.trace")) for line in f.read_text().splitlines()]


def stored_state(cluster: Cluster, job_id: int, step: int) -> dict[str, np.ndarray]:
    blob = (
        cluster.var_dir / "storage" / "jobs" / str(job_id) / "dedloc" / f"state-{step:08d}.safetensors"
    ).read_bytes()
    return {k: v for k, v in decode(blob).items() if not k.startswith("__")}


def digests_per_step(cluster: Cluster, job_id: int, steps: range) -> dict[int, dict[str, str]]:
    with cluster.admin() as http:
        return {s: http.get(f"/v1/dedloc/jobs/{job_id}/digests/{s}").json() for s in steps}


def commits(cluster: Cluster, job_id: int) -> dict[int, dict]:
    with cluster.admin() as http:
        return {int(k): v for k, v in http.get(f"/v1/dedloc/jobs/{job_id}/commits").json().items()}


def new_process_groups(cluster: Cluster, name: str) -> int:
    """How many process groups the peer process `name` built (a rendezvous each), from its log."""
    return (cluster.var_dir / "logs" / f"{name}.log").read_text().count("new process group for session")


def assert_one_collaboration(cluster: Cluster, job_id: int, steps: range) -> None:
    """Every peer that reported parameters at a step holds the uploaded state of that step."""
    for step, by_peer in digests_per_step(cluster, job_id, steps).items():
        stored = cluster.var_dir / "storage" / "jobs" / str(job_id) / "dedloc" / f"state-{step:08d}.safetensors"
        assert by_peer, f"no peer reported parameters at step {step}"
        assert len(set(by_peer.values())) == 1, f"step {step}: peers differ: {by_peer}"
        if stored.exists():
            assert set(by_peer.values()) == {dedloc.digest(stored_state(cluster, job_id, step))}


def wait_until(check, timeout: float, message: str, peers: list[Service]) -> None:
    """Poll `check` (a state of the job, not a time) while the peers run."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{message} within {timeout}s\n" + "\n".join(p.tail(15) for p in peers)
        assert all(p.alive for p in peers), "a peer exited:\n" + "\n".join(p.tail() for p in peers)
        time.sleep(0.2)


def peer_ids(cluster: Cluster, name: str) -> set[str]:
    """The peer id(s) the process `name` joined as, from its log."""
    log = (cluster.var_dir / "logs" / f"{name}.log").read_text()
    return {line.split("peer ", 1)[1].split(" ", 1)[0] for line in log.splitlines() if "joined job" in line}
