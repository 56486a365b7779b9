"""Adversarial benchmark: the example job with hostile hosts in 20% of its slots, one strategy at a time.

What it measures
    For each hostile strategy: whether the example job (examples/mnist1d-cnn.yaml, target 0.90, with
    a `validation:` section that replicates untrusted hosts' work) still reaches its target; the
    examples it needs to first reach it (examples of the merged results up to the first evaluation
    of W_s at or above the target), divided by those of the same job with no hostile host (`clean`),
    measured in the same run; how many hostile results were merged, validated and refused; and the
    hostile host's final reputation, credit and quarantine. The credit of hostile results is given
    apart from the host's: a replaying host's first result is honest work, and earns credit.
    `clean-unvalidated` is the job without `validation:`, so the cost of replication shows beside
    `clean`: the examples trained by every host up to the target (replicas that were not merged
    included) and the seconds to target.

How
    One `Cluster` (private redis-server, scheduler on SQLite, transitioner, Celery parameter
    servers) for the whole run; per (strategy, seed) a job with the spec's seed set to the seed, four
    real `crowdtrain client` processes with 1 task slot each (volunteer accounts honest-0..honest-3,
    each bound to a loopback address of its own, 127.0.1i.1: a vote that asks for a third replica
    needs a third account and network, and replicas never share one), and, unless clean, one hostile
    host with 1 slot (20% of the 5 slots) under an account of its own (its name, j<job>-hostile),
    scripted over HTTP from this process (crowdtrain/launch/scripted_host.py). Fresh hosts and
    accounts every job: a quarantine follows the account, and a host's reputation is its own.
    The hostile host asks for work, downloads the snapshot W_base and
    the shard as a client does, and uploads (Δ: the update of honest training from W_base with the
    client's trainer and the assignment's recipe):
        sign-flip   W_base − Δ
        scaled      W_base + 10·Δ
        noise       W_base + Gaussian noise of norm ||Δ||
        permuted    trained from W_base on the shard with its labels mapped by a fixed permutation
                    of the classes (no class keeps its label)
        replay      its first result (trained honestly), uploaded again for every later assignment
        lazy        W_base unchanged
        lazy-unvalidated
                    W_base unchanged, in the job without `validation:` (as `clean-unvalidated`): only
                    the merge policy, which refuses an update that carries no training, stands in its way
        re-register W_base + noise of each tensor's scale, untrained; whenever it is given no work twice
                    in a row (quarantined) it registers again with the same join token, name and
                    account and goes on: hostile_hosts_registered counts its hosts, the credit is theirs
        colluding-pair  two hostile hosts (accounts j<job>-hostile and j<job>-hostile-2, on networks 127.0.1.1 and
                    127.0.2.1), each W_base + d + ε with d shared by the pair (drawn from the seed and
                    the workunit id, ||d|| = 0.1·||W_base||) and ε private: they agree when both hold
                    replicas of one workunit, and neither trains
    reporting the metrics an honest client would. Validation: replicate_untrusted, trusted_after 4
    (the honest hosts are trusted after 4 valid results in a row, then spot-checked at replication
    0.1; a hostile host is never trusted: no strategy returns 4 valid results in a row by design,
    and a replaying host's one honest result is not enough), the spec's defaults for the rest
    (quarantine after 5 refusals in a row). Figures come from the ledger (`assignments`, `metrics`)
    and `GET /v1/admin/hosts`.

Run
    .venv/bin/python benchmarks/adversarial.py --quick
    .venv/bin/python benchmarks/adversarial.py [--strategies sign-flip,lazy,...] [--seeds 2]
    A job takes 1-2 minutes on 2 cores: --quick runs 5 jobs, the default 16.

Progress and a table go to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import select

from adversarial_summary import CLEAN, GOAL_RATIO, NO_CREDIT_FOR, UNVALIDATED, print_table, summarize
from crowdtrain.client.trainers import limit_threads
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job, Metric
from efficiency_report import examples_to_target, merge_curve, say
from hostile_strategies import COLLUDING_PAIR, ColludingPair, HostileHost, hostile_host
from job_progress import wait_for_job

EXAMPLE_SPEC = Path(__file__).resolve().parents[1] / "examples" / "mnist1d-cnn.yaml"
STRATEGIES = (
    "sign-flip",
    "scaled",
    "noise",
    "permuted",
    "replay",
    "lazy",
    "lazy-unvalidated",
    "re-register",
    COLLUDING_PAIR,
)
QUICK_STRATEGIES = ("sign-flip", "replay", "lazy")
VALIDATION = {"replicate_untrusted": True, "replication": 0.1, "trusted_after": 4}
HONEST_CLIENTS, HONEST_TASKS = 4, 1  # 4 honest slots beside 1 hostile slot: 20%


# ---------------------------------------------------------------- one job


def job_spec(seed: int, validated: bool) -> dict:
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["seed"] = seed
    if validated:
        spec["validation"] = spec.get("validation", {}) | VALIDATION
    return spec


def job_figures(cluster: Cluster, job_id: int, target: float, hostile_ids: list[int]) -> dict:
    """From the ledger: examples merged to target, examples trained to target, and what became of
    the hostile host's results."""
    db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        started = job.started_at
        rows = s.execute(
            select(
                Assignment.id,
                Assignment.host_id,
                Assignment.status,
                Assignment.merged_version,
                Assignment.examples,
                Assignment.uploaded_at,
                Assignment.credit,
                Assignment.message,
            ).where(Assignment.job_id == job_id)
        ).all()
        metrics = s.execute(
            select(Metric.param_version, Metric.val_accuracy, Metric.created_at)
            .where(Metric.job_id == job_id)
            .order_by(Metric.param_version)
        ).all()
    db.kw["bind"].dispose()
    merged = [r for r in rows if r.merged_version is not None]
    curve = merge_curve(
        [(r.merged_version, r.examples or 0) for r in merged], [(m.param_version, m.val_accuracy) for m in metrics]
    )
    hit = next((m for m, (_, acc) in zip(metrics, curve, strict=True) if acc >= target), None)
    until = hit.created_at if hit is not None else None
    trained = [r for r in rows if r.uploaded_at is not None and (until is None or r.uploaded_at <= until)]
    return {
        "examples_to_target": examples_to_target(curve, target),
        "best_accuracy": round(max((a for _, a in curve), default=0.0), 4),
        "merges": len(merged),
        "seconds_to_target": round((until - started).total_seconds(), 1) if until and started else None,
        "examples_trained_to_target": sum(r.examples or 0 for r in trained) if until else None,
        "hostile": {r.id: (r.status, r.credit or 0.0, r.message) for r in rows if r.host_id in hostile_ids},
    }


def reason(message: str) -> str:
    """A refusal's reason with its figures left out, so that like refusals count together."""
    return re.sub(r"-?\d+(\.\d+)?", "#", message.removeprefix("refused by replica validation: "))[:90]


def run_job(cluster: Cluster, strategy: str, seed: int, timeout: float) -> dict:
    """One job with the honest clients and, unless clean, one hostile host playing `strategy`."""
    label = f"{strategy} seed {seed}"
    spec = job_spec(seed, validated=not strategy.endswith("-unvalidated"))
    target = spec["stop"]["target_accuracy"]
    job_id = cluster.submit(spec)["job_id"]
    say(f"{label}: job {job_id}")
    started = time.monotonic()
    clients = [
        cluster.start_client(
            f"j{job_id}-honest-{i}", HONEST_TASKS, "--account", f"honest-{i}", "--bind-address", f"127.0.1{i}.1"
        )
        for i in range(HONEST_CLIENTS)
    ]
    hostile = None if strategy in (CLEAN, UNVALIDATED) else hostile_host(cluster, f"j{job_id}-hostile", strategy, seed)
    try:
        if hostile is not None:
            hostile.start()
        status = wait_for_job(cluster, job_id, clients, timeout, label)
    finally:
        if hostile is not None:
            hostile.stop()
        with cluster.admin() as http:
            http.post(f"/v1/jobs/{job_id}/cancel")
        for c in clients:
            c.stop()
    seconds = round(time.monotonic() - started, 1)
    figures = job_figures(cluster, job_id, target, hostile.host_ids if hostile else [])
    results = figures.pop("hostile")
    row = {"strategy": strategy, "seed": seed, "job_id": job_id, "job_status": status, "seconds": seconds} | figures
    with cluster.admin() as http:
        listed = [h for h in http.get("/v1/admin/hosts").json() if h["name"].startswith(f"j{job_id}-")]
    records = {h["name"]: h for h in listed}  # a re-registering host's name: its last host
    honest = [h for name, h in records.items() if "-honest-" in name]
    row["honest_refused"] = sum(h["results_failed"] for h in honest)
    row["honest_quarantined"] = sum(h["quarantined_until"] is not None for h in honest)
    if hostile is not None:
        row |= hostile_figures(hostile, results, [r for name, r in records.items() if "-hostile" in name])
        row["hostile_hosts_registered"] = len(hostile.host_ids)
        row["hostile_credit"] = round(sum(h["credit"] for h in listed if h["id"] in hostile.host_ids), 6)
    say(f"{label}: {describe(row)}")
    return row


def hostile_figures(
    hostile: HostileHost | ColludingPair, results: dict[int, tuple[str, float, str]], records: list[dict]
) -> dict:
    """What became of the hostile hosts' results (by final status), their attacks merged and credited,
    the main reasons for their refusals, and their records (the lowest reputation, credit summed,
    quarantined if any is)."""
    attacks = [aid for aid, attack, _ in hostile.uploads if attack]
    return {
        "hostile_uploads": len(hostile.uploads),
        "hostile_attacks": len(attacks),
        "hostile_results": dict(Counter(status for status, _, _ in results.values())),
        "hostile_merged": sum(status == "merged" for status, _, _ in results.values()),
        "hostile_validated": sum(status == "validated" for status, _, _ in results.values()),
        "hostile_attacks_merged": sum(results.get(aid, ("",))[0] == "merged" for aid in attacks),
        "hostile_attack_credit": round(sum(results.get(aid, ("", 0.0))[1] for aid in attacks), 6),
        "hostile_refusals": dict(
            Counter(reason(msg) for status, _, msg in results.values() if status == "rejected").most_common(4)
        ),
        "hostile_reputation": round(min(r["reputation"] for r in records), 3),
        "hostile_credit": round(sum(r["credit"] for r in records), 6),
        "hostile_quarantined": any(r["quarantined_until"] is not None for r in records),
        "hostile_quarantine_reason": "; ".join(r["quarantine_reason"] for r in records if r["quarantine_reason"])[:200],
        "hostile_error": hostile.error,
    }


def describe(row: dict) -> str:
    text = (
        f"{row['job_status']} in {row['seconds']}s; target at {row['examples_to_target']} examples merged "
        f"({row['examples_trained_to_target']} trained, {row['seconds_to_target']}s), {row['merges']} merges"
    )
    if "hostile_reputation" in row:
        text += (
            f"; hostile: {row['hostile_results']}, attacks merged {row['hostile_attacks_merged']}, "
            f"reputation {row['hostile_reputation']}, credit {row['hostile_credit']:.3g} "
            f"(for attacks {row['hostile_attack_credit']:.3g}), quarantined {row['hostile_quarantined']}; "
            f"refusals {row['hostile_refusals']}"
        )
    return text


# ---------------------------------------------------------------- command line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated, of {', '.join(STRATEGIES)} (the clean runs always run)",
    )
    parser.add_argument("--seeds", type=int, default=2, help="jobs per strategy, seeds 0..N-1")
    parser.add_argument("--quick", action="store_true", help=f"one seed, {', '.join(QUICK_STRATEGIES)} only")
    parser.add_argument("--job-timeout", type=float, default=300, help="seconds a job may run")
    parser.add_argument("--out", type=Path, help="also write the JSON figures here (the runs so far after each job)")
    args = parser.parse_args()
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip() not in ("", CLEAN, UNVALIDATED)]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies {unknown}; expected some of {list(STRATEGIES)}")
    if args.quick:
        strategies, args.seeds = [s for s in strategies if s in QUICK_STRATEGIES], 1
    limit_threads(1)  # the hostile host trains in this process, on one thread like each client slot
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(var_dir=Path(tmp)).start()
        try:
            for seed in range(args.seeds):
                for strategy in (CLEAN, UNVALIDATED, *strategies):
                    rows.append(run_job(cluster, strategy, seed, args.job_timeout))
                    if args.out:  # the runs so far, should the benchmark be stopped
                        args.out.write_text(json.dumps({"runs": rows}, indent=2))
        finally:
            cluster.stop()
    summary = summarize(rows)
    print_table(summary)
    figures = {
        "benchmark": "adversarial",
        "hostile_share_of_slots": 1 / (HONEST_CLIENTS * HONEST_TASKS + 1),
        "validation": VALIDATION,
        "goal": {"max_ratio": GOAL_RATIO, "no_credit_for": list(NO_CREDIT_FOR)},
        "summary": summary,
        "runs": rows,
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    sys.exit(main())
