"""Adversarial benchmark of the synchronous DeDLOC mode: a peer that poisons the collaboration's state.

What it measures
    The demo DeDLOC job (examples/mnist1d-dedloc.yaml: 1-D CNN on mnist1d, global batch 256, Adam)
    trained by four peers, twice in one run: `clean`, four honest peers; `poisoned`, the same with
    peer 0 hostile (`crowdtrain peer --poison-state`): it trains and reduces honestly and reports its
    real parameter digest, but uploads its parameters x0 as the next state, unasked, whenever a state
    is awaited, brings at most 64 examples a step (it cannot commit steps alone), and registers first
    so that it is each of its commits' designated uploader. For the
    poisoned run: whether its states were refused (and how many), whether it was excluded (refused
    `exclude_after` times and a member of no later commit), its credit, and how many stored states
    are all zeros (must be 0). For both: the examples to reach the target (the examples of the
    committed steps before the first stored state whose validation accuracy reaches it) and the
    poisoned run's over the clean run's (goal <= 1.3).

How
    One `Cluster` (private redis-server, scheduler on SQLite) for the run; per job four real
    `crowdtrain peer` processes, 1 thread each, peer i training data rank i of 4. Figures come from
    the admin API (`/v1/jobs/{id}?metrics=true`, `/v1/dedloc/jobs/{id}/commits`, `.../state-refusals`,
    `/v1/admin/hosts`) and the stored states in the cluster's storage folder.

Run
    .venv/bin/python benchmarks/hostile_dedloc.py [--target 0.9] [--timeout 900] [--seeds 0,1,2]
    --quick sets the target to 0.80. A job takes 1-4 minutes on 2 cores; each seed runs two jobs.
    The examples ratio is reported per seed and as the median over the seeds (the goal's measure).

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.tensors import decode
from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv

SPEC = Path(__file__).resolve().parents[1] / "examples" / "mnist1d-dedloc.yaml"
PEERS = 4
GOAL_RATIO = 1.3
TERMINAL = ("succeeded", "failed", "cancelled")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def start_peer(cluster: Cluster, job_id: int, name: str, rank: int, hostile: bool, world: int = PEERS) -> Service:
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
        "--data-rank",
        str(rank),
        "--data-world",
        str(world),
        # The poisoner brings at most a quarter of a batch a step: it cannot commit steps alone
        # before the honest peers have started (which only sends the collaboration back to step 0).
        *(("--poison-state", "--examples-per-step", "64") if hostile else ()),
    )
    svc = Service(name, argv, cluster.client_env, cluster.var_dir / "logs" / f"{name}.log").start()
    cluster.clients.append(svc)
    return svc


def peer_ids(cluster: Cluster, name: str) -> set[str]:
    """The peer id(s) the process `name` joined as, from its log."""
    log = (cluster.var_dir / "logs" / f"{name}.log").read_text()
    return {line.split("peer ", 1)[1].split(" ", 1)[0] for line in log.splitlines() if "joined job" in line}


def start_peers(cluster: Cluster, job_id: int, label: str, poisoned: bool, count: int = PEERS) -> list[Service]:
    """`count` peers, peer 0 first, until it has joined (the lowest host id: each of its commits'
    designated uploader); peer i trains data rank i of `count`."""
    first = start_peer(cluster, job_id, f"{label}-0", 0, poisoned, count)
    deadline = time.monotonic() + 120
    while not peer_ids(cluster, first.name):
        if time.monotonic() > deadline or not first.alive:
            raise RuntimeError(f"peer 0 never joined:\n{first.tail()}")
        time.sleep(0.2)
    return [first] + [start_peer(cluster, job_id, f"{label}-{i}", i, False, count) for i in range(1, count)]


def wait_finished(cluster: Cluster, job_id: int, peers: list[Service], timeout: float, label: str) -> dict:
    deadline, shown = time.monotonic() + timeout, 0.0
    with cluster.admin() as http:
        while True:
            st = http.get(f"/v1/jobs/{job_id}").json()
            if st["status"] in TERMINAL or time.monotonic() > deadline:
                for p in peers:
                    p.stop()
                return st
            if not any(p.alive for p in peers):
                raise RuntimeError("every peer exited:\n" + "\n".join(p.tail(10) for p in peers))
            if time.monotonic() - shown > 15:
                shown = time.monotonic()
                say(f"  {label}: step {st['param_version']}")
            time.sleep(1.0)


def zeroed_states(cluster: Cluster, job_id: int) -> tuple[int, int]:
    """(stored states whose parameters are all zeros, stored states)."""
    paths = sorted((cluster.var_dir / "storage" / "jobs" / str(job_id) / "dedloc").glob("state-*.safetensors"))
    zeroed = 0
    for path in paths:
        params = [v for k, v in decode(path.read_bytes()).items() if not k.startswith("__")]
        zeroed += all(not np.any(v) for v in params)
    return zeroed, len(paths)


def to_target(metrics: list[dict], commits: dict[int, dict], target: float) -> tuple[int | None, int | None]:
    """(examples, steps) committed before the first stored state at or above `target`. A step commits
    at least the global batch, often more: peers keep computing while its members gather."""
    reached = sorted(m["param_version"] for m in metrics if m["val_accuracy"] >= target)
    if not reached:
        return None, None
    return sum(sum(c["examples"].values()) for step, c in commits.items() if step < reached[0]), reached[0]


def run_job(cluster: Cluster, spec: dict, label: str, poisoned: bool, timeout: float) -> dict:
    with cluster.admin() as http:
        resp = http.post("/v1/jobs", json=spec | {"name": f"dedloc-{label}"})
        resp.raise_for_status()
        job_id = resp.json()["job_id"]
    started = time.monotonic()
    peers = start_peers(cluster, job_id, label, poisoned)
    st = wait_finished(cluster, job_id, peers, timeout, label)
    with cluster.admin() as http:
        metrics = http.get(f"/v1/jobs/{job_id}", params={"metrics": True}).json()["metrics"]
        commits = {int(k): v for k, v in http.get(f"/v1/dedloc/jobs/{job_id}/commits").json().items()}
        refused = http.get(f"/v1/dedloc/jobs/{job_id}/state-refusals").json()
        hosts = http.get("/v1/admin/hosts").json()
    hostile = peer_ids(cluster, f"{label}-0")
    member_of = sorted(s for s, c in commits.items() if hostile & set(c["members"]))
    host_ids = {int(p.split("-", 1)[0][1:]) for p in hostile}
    zeroed, stored = zeroed_states(cluster, job_id)
    exclude_after = spec["dedloc"].get("exclude_after", 3)
    examples, steps = to_target(metrics, commits, spec["stop"]["target_accuracy"])
    row = {
        "status": st["status"],
        "seconds": round(time.monotonic() - started, 1),
        "examples_to_target": examples,
        "steps_to_target": steps,
        "stored_states": stored,
        "zeroed_states_stored": zeroed,
    }
    if poisoned:
        n_refused = sum(refused.get(p, 0) for p in hostile)
        row |= {
            "poisoner_states_refused": n_refused,
            "poisoner_excluded": n_refused >= exclude_after and (not member_of or member_of[-1] < max(commits)),
            "poisoner_last_commit": member_of[-1] if member_of else None,
            "poisoner_credit": sum(h["credit"] for h in hosts if h["id"] in host_ids),
        }
    say(f"  {label}: {row}")
    return row


def _ratio(a: int | None, b: int | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _median(values: list[float]) -> float | None:
    return round(float(np.median(values)), 3) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=float, default=None, help="validation accuracy to reach (default: the spec's)")
    ap.add_argument("--quick", action="store_true", help="target 0.80")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--seeds", default="0", help="job seeds, comma-separated: one clean and one poisoned job each")
    args = ap.parse_args()
    try:
        seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not seeds:
        ap.error("--seeds: give at least one seed")
    spec = load_job_spec(SPEC).model_dump(mode="json", exclude_none=True)
    target = args.target or (0.80 if args.quick else spec["stop"]["target_accuracy"])
    spec["stop"]["target_accuracy"] = target
    runs = []
    with tempfile.TemporaryDirectory(prefix="hostile-dedloc-") as tmp:
        cluster = Cluster(var_dir=Path(tmp), assimilator_concurrency=1).start()
        try:
            for seed in seeds:
                seeded = spec | {"seed": seed}
                clean = run_job(cluster, seeded, f"clean-s{seed}", False, args.timeout)
                poisoned = run_job(cluster, seeded, f"poisoned-s{seed}", True, args.timeout)
                ratio = _ratio(poisoned["examples_to_target"], clean["examples_to_target"])
                steps_ratio = _ratio(poisoned["steps_to_target"], clean["steps_to_target"])
                say(
                    f"seed {seed}: clean {clean['examples_to_target']} examples to {target}; poisoned "
                    f"{poisoned['examples_to_target']} (ratio {ratio}, goal <= {GOAL_RATIO}; steps ratio "
                    f"{steps_ratio}); poisoner refused {poisoned['poisoner_states_refused']} state(s), excluded "
                    f"{poisoned['poisoner_excluded']}, credit {poisoned['poisoner_credit']}; zeroed states "
                    f"stored {poisoned['zeroed_states_stored']}"
                )
                runs.append(
                    {
                        "seed": seed,
                        "clean": clean,
                        "poisoned": poisoned,
                        "examples_ratio": ratio,
                        "steps_ratio": steps_ratio,
                    }
                )
        finally:
            cluster.stop()
    # One pair's ratio carries the run-to-run spread of asynchronous peers (1.0-1.6 on one seed):
    # the goal is judged on the median over the seeds.
    ratio = _median([r["examples_ratio"] for r in runs if r["examples_ratio"] is not None])
    print(
        json.dumps(
            {
                "benchmark": "hostile_dedloc",
                "target": target,
                "runs": runs,
                "examples_ratio_median": ratio,
                "steps_ratio_median": _median([r["steps_ratio"] for r in runs if r["steps_ratio"] is not None]),
                "zeroed_states_stored": sum(r["poisoned"]["zeroed_states_stored"] for r in runs),
                "poisoner_always_excluded": all(r["poisoned"]["poisoner_excluded"] for r in runs),
                "goal_ratio": GOAL_RATIO,
                "within_goal": ratio is not None and ratio <= GOAL_RATIO,
            }
        )
    )


if __name__ == "__main__":
    main()
