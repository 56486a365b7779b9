"""Seconds per step of a DeDLOC job: how fast the collaboration's coordination lets peers step.

What it measures
    The demo DeDLOC job (examples/mnist1d-dedloc.yaml: 1-D CNN on mnist1d, global batch 256 in
    micro-batches of 32) trained by `--peers` real `crowdtrain peer` processes (1 thread each, peer i
    training data rank i) for `--steps` steps, its target set out of reach so that every run takes
    the same number of steps. A step is 256 examples of computing (8 micro-batches over all peers),
    then the coordination: the reports that close the step, matchmaking, the all-reduce of a small
    model's gradient, the members' outcomes and the commit. On a model this small the coordination
    is most of a step, so this is its measure.

    `s_per_step_median` / `s_per_step_mean`: the gaps between consecutive commits (their `at`, from
    `/v1/dedloc/jobs/{id}/commits`), the first WARMUP commits left out (peers joining, first groups).
    `steps_per_s` is 1 / the median.

How
    One `Cluster` (private redis-server, scheduler on SQLite, local storage) in a temporary folder;
    the peers are started as benchmarks/hostile_dedloc.py starts its honest ones.

Run
    .venv/bin/python benchmarks/dedloc_steps.py [--steps 60] [--peers 4] [--timeout 900]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import Cluster
from hostile_dedloc import SPEC, start_peers, wait_finished

WARMUP = 5  # commits left out: peers joining, the first groups' rendezvous


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help=f"steps the job runs (more than {WARMUP + 1})")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900, help="seconds the job may take")
    args = ap.parse_args()
    if args.steps <= WARMUP + 1:
        ap.error(f"--steps must be more than {WARMUP + 1}: the first {WARMUP} commits are warm-up")
    spec = load_job_spec(SPEC).model_dump(mode="json")
    spec["stop"] = spec["stop"] | {"target_accuracy": 1.0, "max_steps": args.steps}  # every run takes every step
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(var_dir=Path(tmp)).start()
        try:
            job_id = cluster.submit(spec)["job_id"]
            peers = start_peers(cluster, job_id, "peer", False, args.peers)
            status = wait_finished(cluster, job_id, peers, args.timeout, "peers")
            with cluster.admin() as http:
                commits = http.get(f"/v1/dedloc/jobs/{job_id}/commits").json()
        finally:
            cluster.stop()
    at = sorted(c["at"] for c in commits.values())
    if len(at) <= WARMUP + 1:
        sys.exit(f"only {len(at)} steps were committed (job {status['status']}): {status.get('status_message')}")
    gaps = [b - a for a, b in zip(at[WARMUP:], at[WARMUP + 1 :], strict=False)]
    median = statistics.median(gaps)
    print(
        f"{len(at)} steps, {args.peers} peers: {median:.3f}s a step (median of {len(gaps)}), "
        f"{statistics.mean(gaps):.3f}s mean",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "peers": args.peers,
                "steps": len(at),
                "s_per_step_median": median,
                "s_per_step_mean": statistics.mean(gaps),
                "steps_per_s": 1 / median,
            }
        )
    )


if __name__ == "__main__":
    main()
