"""What one hostile host costs the example job: accuracy and time to target with and without it.

What it measures
    The example job (examples/mnist1d-cnn.yaml, target 0.90) trained by one honest client with
    two task slots, once alone and once beside a hostile host that uploads, twice each, (a) all
    values 1e30, (b) W_base − 100·Δ for a Δ of plausible norm, (c) W_base + noise of plausible
    norm (the attacks of tests/test_adversarial_host.py). For each run: the job's outcome, its final
    accuracy (the exported model's), the seconds to finish, and what became of each hostile upload.

How
    A fresh real `Cluster` (private redis-server, scheduler on SQLite, transitioner, Celery
    parameter server) per run, `--seeds` runs of each kind. The hostile host is scripted over HTTP
    from this process (crowdtrain/launch/scripted_host.py); its second round of uploads waits until
    the honest client's merges have moved W_s on (the norm bound follows accepted updates by then).

Run
    .venv/bin/python benchmarks/hostile_host.py [--seeds 1]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import select

from crowdtrain.assimilator.rules.update import params_norm
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.tensors import Params
from crowdtrain.launch.cluster import Cluster, wait_for
from crowdtrain.launch.scripted_host import ScriptedHost
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job

EXAMPLE_SPEC = Path(__file__).resolve().parents[1] / "examples" / "mnist1d-cnn.yaml"
ATTACKS = ("1e30", "sign-flipped x100", "noise")
JOB_TIMEOUT = 300


def hostile_update(kind: str, base: Params, rng: np.random.Generator) -> Params:
    """W_c for one attack, from the snapshot the host was given. A plausible update norm is half
    ||W_base|| (honest ones of this job measure 0.3-1.5 x ||W_base||)."""
    direction = {k: rng.standard_normal(v.shape) for k, v in base.items() if v.dtype.kind == "f"}
    scale = 0.5 * params_norm(base) / params_norm(direction)
    out = dict(base)
    for k, d in direction.items():
        if kind == "1e30":
            out[k] = np.full_like(base[k], 1e30)
        elif kind == "sign-flipped x100":  # W_base - 100 * Δ for a Δ of plausible norm
            out[k] = (base[k] - 100 * scale * d).astype(base[k].dtype)
        else:
            out[k] = (base[k] + scale * d).astype(base[k].dtype)
    return out


def _job(cluster: Cluster, job_id: int) -> Job:
    with session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}").begin() as s:
        return s.get_one(Job, job_id)


def attack(cluster: Cluster, job_id: int, seed: int, rounds: int = 2) -> list[tuple[int, str]]:
    """Upload each attack `rounds` times; (assignment id, attack) of each upload."""
    mallory = ScriptedHost(cluster.url, cluster.join_token, "mallory")
    rng = np.random.default_rng(seed)
    sent: list[tuple[int, str]] = []
    for r in range(rounds):
        if r:
            wait_for(
                lambda r=r: _job(cluster, job_id).param_version >= 6 * r or _job(cluster, job_id).status != "running",
                JOB_TIMEOUT,
                "the honest client's merges stopped",
            )
        for kind in ATTACKS:
            if _job(cluster, job_id).status != "running":
                return sent
            work = mallory.next_assignment()
            resp = mallory.upload(work, hostile_update(kind, mallory.snapshot(work), rng))
            if resp.status_code != 202:
                raise RuntimeError(f"the scheduler refused a well-formed upload: {resp.text}")
            sent.append((work["assignment_id"], kind))
    return sent


def run_example_job(cluster: Cluster, hostile: bool, seed: int) -> dict:
    """The example job trained by one honest client with 2 slots (and the hostile host); its final figures."""
    job_id = cluster.submit(load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))["job_id"]
    cluster.start_client("alice", tasks=2)
    started = time.monotonic()
    sent = attack(cluster, job_id, seed) if hostile else []
    wait_for(lambda: _job(cluster, job_id).status != "running", JOB_TIMEOUT, "the job did not finish")
    job = _job(cluster, job_id)
    return {
        "status": job.status,
        "final_accuracy": job.final_accuracy,
        "seconds": time.monotonic() - started,
        "attacks": sent,
    }


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
