"""The fraction of a client's wall time spent training, with and without prefetch.

What it measures
    One client with one task slot runs `--assignments` assignments of about `--task-seconds`
    each (default 20 of ~10 s) against a real cluster, once with prefetch (the next assignment
    is requested and its snapshot and shard downloaded, hashed and decoded while the current one
    trains; the result is uploaded while the next one trains) and once without. Utilization is
    the sum of the training seconds the client reported for its results, divided by the client's
    wall time from its first dispatch to its last upload. The per-assignment overhead is the
    wall time not spent training, divided by the number of assignments.

How
    A real `Cluster` (private redis-server, scheduler on SQLite, transitioner, one Celery
    parameter server) in a temporary directory. The job is mnist1d with an MLP of two 2,048-unit
    hidden layers (4.3M parameters, a 17 MB snapshot and a 17 MB upload per assignment, since
    every merge publishes a new snapshot), in 4 shards; `local_epochs` is calibrated before the
    run so that one assignment trains for about `--task-seconds` with one CPU thread. The client
    transfers at most `--rate` bytes/s each way (default 12.5 MB/s, a 100 Mbit/s home line;
    `--rate 0` is unlimited loopback). Each mode gets its own job and a client with an empty cache.

Run
    .venv/bin/python benchmarks/client_utilization.py [--assignments 20] [--task-seconds 10] [--rate 12.5e6]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from sqlalchemy import select

from crowdtrain.client.trainers import limit_threads, train
from crowdtrain.core.jobspec import JobSpec
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host
from crowdtrain.workgen.datasets import load_dataset, split_shards

HIDDEN = [2048, 2048]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def calibrate_local_epochs(task_seconds: float) -> tuple[int, float]:
    """Local epochs that make one assignment train for about `task_seconds` on one thread."""
    limit_threads(1)
    data = load_dataset("builtin:mnist1d")
    shard = split_shards(len(data.x), 4)[0]
    params = state_to_numpy(build_model("mlp", data.input_shape, data.num_classes, hidden=HIDDEN))
    recipe = {
        "model": {
            "name": "mlp",
            "input_shape": data.input_shape,
            "num_classes": data.num_classes,
            "options": {"hidden": HIDDEN},
        },
        "training": {
            "local_epochs": 2,
            "batch_size": 32,
            "optimizer": "sgd",
            "lr": 0.01,
            "momentum": 0.9,
            "weight_decay": 0.0,
        },
        "seed": 0,
    }
    train("pytorch", recipe, params, data.x[shard], data.y[shard])  # warm-up
    seconds_per_epoch = train("pytorch", recipe, params, data.x[shard], data.y[shard]).seconds / 2
    return max(1, round(task_seconds / seconds_per_epoch)), seconds_per_epoch


def job_spec(name: str, local_epochs: int) -> dict:
    return JobSpec.model_validate(
        {
            "name": name,
            "model": {"name": "mlp", "options": {"hidden": HIDDEN}},
            "dataset": {"source": "builtin:mnist1d", "subsets": 4},
            "training": {
                "local_epochs": local_epochs,
                "batch_size": 32,
                "optimizer": "sgd",
                "lr": 0.01,
                "momentum": 0.9,
            },
            "stop": {"target_accuracy": 1.0, "max_epochs": 1000},
            "scheduling": {"deadline_seconds": 3600},
        }
    ).model_dump(mode="json")


def run_mode(cluster: Cluster, prefetch: bool, assignments: int, local_epochs: int, rate: float) -> dict:
    name = "prefetch" if prefetch else "no-prefetch"
    job_id = cluster.submit(job_spec(f"utilization-{name}", local_epochs))["job_id"]
    args = ["--prefetch" if prefetch else "--no-prefetch", "--max-assignments", str(assignments)]
    if rate:
        args += ["--max-download-rate", str(rate), "--max-upload-rate", str(rate)]
    client = cluster.start_client(name, 1, *args)
    say(f"{name}: job {job_id}, {assignments} assignments ...")
    if client.proc.wait(assignments * 120) != 0:
        raise RuntimeError(f"client {name} failed:\n{client.tail()}")
    with cluster.admin() as http:
        http.post(f"/v1/jobs/{job_id}/cancel")
    db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
    with db.begin() as s:
        rows = s.execute(
            select(Assignment.sent_at, Assignment.uploaded_at, Assignment.train_seconds)
            .join(Host)
            .where(Host.name == name, Assignment.uploaded_at.is_not(None))
        ).all()
    if len(rows) != assignments:
        raise RuntimeError(f"{name}: {len(rows)} results uploaded, expected {assignments}")
    wall = (max(r.uploaded_at for r in rows) - min(r.sent_at for r in rows)).total_seconds()
    training = sum(r.train_seconds for r in rows)
    figures = {
        "assignments": len(rows),
        "wall_seconds": round(wall, 2),
        "training_seconds": round(training, 2),
        "mean_task_seconds": round(training / len(rows), 2),
        "utilization": round(training / wall, 4),
        "overhead_seconds_per_assignment": round((wall - training) / len(rows), 3),
    }
    say(f"{name}: {figures}")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--assignments", type=int, default=20)
    ap.add_argument("--task-seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=12.5e6, help="client transfer cap, bytes/s each way (0: none)")
    args = ap.parse_args()
    local_epochs, per_epoch = calibrate_local_epochs(args.task_seconds)
    say(f"calibrated: {per_epoch:.2f}s per local epoch -> local_epochs {local_epochs}")
    with tempfile.TemporaryDirectory(prefix="ct-util-") as tmp:
        cluster = Cluster(var_dir=Path(tmp), assimilator_concurrency=1)
        cluster.start()
        try:
            with_prefetch = run_mode(cluster, True, args.assignments, local_epochs, args.rate)
            without = run_mode(cluster, False, args.assignments, local_epochs, args.rate)
        finally:
            cluster.stop()
    print(
        json.dumps(
            {
                "benchmark": "client_utilization",
                "model": "mlp 2048x2048 (4.3M parameters)",
                "local_epochs": local_epochs,
                "rate_bytes_per_s": args.rate,
                "prefetch": with_prefetch,
                "no_prefetch": without,
                "utilization_prefetch": with_prefetch["utilization"],
                "utilization_no_prefetch": without["utilization"],
                "goal_prefetch": 0.95,
                "overhead_ratio_prefetch_vs_none": round(
                    with_prefetch["overhead_seconds_per_assignment"] / without["overhead_seconds_per_assignment"], 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
