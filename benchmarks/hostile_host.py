"""What one hostile host costs the example job: accuracy and time to target with and without it.

What it measures
    The example job (examples/mnist1d-cnn.yaml, target 0.90) trained by one honest client with
    two task slots, once alone and once beside a hostile host that uploads, twice each, (a) all
    values 1e30, (b) W_base − 100·Δ for a Δ of plausible norm, (c) W_base + noise of plausible
    norm (see tests/test_adversarial_host.py). For each run: the job's outcome, its final
    accuracy (the exported model's), the seconds to finish, and what became of each hostile upload.

How
    A fresh real `Cluster` (private redis-server, scheduler on SQLite, transitioner, Celery
    parameter server) per run, `--seeds` runs of each kind.

Run
    PYTHONPATH=. .venv/bin/python benchmarks/hostile_host.py [--seeds 1]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from sqlalchemy import select

from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment
from tests.test_adversarial_host import run_example_job


def one_run(hostile: bool, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(var_dir=Path(tmp)).start()
        try:
            run = run_example_job(cluster, hostile, seed)
            db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
            with db.begin() as s:
                run["attacks"] = [
                    (kind, s.scalar(select(Assignment.status).where(Assignment.id == aid)))
                    for aid, kind in run["attacks"]
                ]
        finally:
            cluster.stop()
    print(
        f"hostile={hostile} seed={seed}: {run['status']} in {run['seconds']:.0f}s, final accuracy "
        f"{run['final_accuracy']:.3f}, attacks {run['attacks']}",
        file=sys.stderr,
        flush=True,
    )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args()
    runs = {
        name: [one_run(hostile, seed) for seed in range(args.seeds)]
        for name, hostile in (("without", False), ("with", True))
    }
    print(
        json.dumps(
            {
                name: [{k: r[k] for k in ("status", "final_accuracy", "seconds", "attacks")} for r in rs]
                for name, rs in runs.items()
            }
        )
    )


if __name__ == "__main__":
    main()
