"""Replica evidence benchmark: does the validator's training evidence (crowdtrain.assimilator.evidence:
training z and descent z) refuse results that did not train, and never an honest one, across a whole
training run?

What it measures
    For each task (the example job on builtin:mnist1d, and a 5-class tabular MLP: efficiency_tasks'
    `tabular`), a whole VC-ASGD run with the job's own rule, recipe and shards, until W_s reaches the
    task's target (or --max-epochs): every honest result is the client's trainer run from a base
    `--staleness` merges old, as `--slots` concurrent hosts give it. For each honest result:
      - its training z: W_c against W_base, per-example losses on the first `training_examples` of its
        own shard, and its descent z: the slope of that shard's loss along Δ against random directions'
        (what the vote measures);
      - the same two for forged results of the colluding pair, W_base + d + ε with a random direction d
        shared by the pair and ε a small private noise (||ε|| = 5% of ||d||), at ||d|| = 0.1, 1 and 3
        times the honest ||Δ||;
      - the held-out z of the other candidate rule: W_s merged alone with the result against W_s, on
        the validation slice (what "lowers the held-out loss of W_s" would measure), for comparison.
    Reported: the honest results' distribution of both (min, 1st percentile, median), the false-refusal
    rate at the job-spec defaults min_training_z, min_descent_z and training_z_alone (before the target; after it,
    nothing to refuse), the catch rate of the forgeries with both checks and with the training z alone,
    and the same two rates for the held-out z at threshold 2.

Run
    .venv/bin/python benchmarks/replica_improvement.py [--tasks mnist1d,tabular] [--seeds 1]
    About two minutes per task and seed on 2 cores.

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from crowdtrain.assimilator.evaluate import evaluate, example_losses
from crowdtrain.assimilator.evidence import measure
from crowdtrain.assimilator.policy import Policy, merged_alone
from crowdtrain.assimilator.rules import make_rule
from crowdtrain.assimilator.rules.update import Update
from crowdtrain.assimilator.validator import training_z, untrained
from crowdtrain.client.trainers import limit_threads
from crowdtrain.client.trainers.pytorch import train
from crowdtrain.core.tensors import Params
from crowdtrain.core.validationspec import ValidationSpec
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.workgen.datasets import Dataset, deal_shards, load_dataset
from efficiency_report import say
from efficiency_tasks import make_task

FORGED_SCALES = (0.1, 1.0, 3.0)
HELD_OUT_THRESHOLD = 2.0
_job_ids = itertools.count(-1000, -1)  # evaluation caches models per job id: never a real job's


def floats(params: Params) -> list[str]:
    return [k for k, v in params.items() if v.dtype.kind == "f"]


def colluding_pair(base: Params, honest: Params, scale: float, rng: np.random.Generator) -> Params:
    """One of a colluding pair's results: W_base + d + ε, d a random direction of `scale`·||Δ_honest||
    (the pair would share it), ε a private noise of 5% of ||d||."""
    keys = floats(base)
    d = {k: rng.standard_normal(base[k].shape) for k in keys}
    eps = {k: rng.standard_normal(base[k].shape) for k in keys}
    norm = lambda t: np.sqrt(sum(float(np.sum(np.square(t[k], dtype=np.float64))) for k in keys))  # noqa: E731
    honest_norm = np.sqrt(sum(float(np.sum((honest[k] - base[k]).astype(np.float64) ** 2)) for k in keys))
    size = scale * honest_norm
    return {
        k: (v + size * (d[k] / norm(d) + 0.05 * eps[k] / norm(eps))).astype(v.dtype) if k in d else v
        for k, v in base.items()
    }


def z_on(job_id: int, config: dict, before: Params, after: Params, x: np.ndarray, y: np.ndarray) -> float:
    return training_z(example_losses(job_id, config, before, x, y)[0], example_losses(job_id, config, after, x, y)[0])


def evidence_of(
    job_id: int, config: dict, before: Params, after: Params, x: np.ndarray, y: np.ndarray, rng: np.random.Generator
) -> tuple[float, float]:
    """(training z, descent z) of `after` against `before`, as the vote measures them."""
    delta = {k: after[k] - before[k] for k in floats(after)}
    return measure(job_id, config, after, delta, (x, y), ValidationSpec().descent_directions, rng)


def model_config(m: dict, data: Dataset) -> dict:
    return {
        "name": m["name"],
        "framework": "pytorch",
        "input_shape": data.input_shape,
        "num_classes": data.num_classes,
        "options": m["options"],
    }


def run_task(name: str, folder: Path, seed: int, slots: int, max_epochs: int) -> dict:
    """One run of task `name`: the z of every honest result and of its forgeries, and the held-out z."""
    task = make_task(name, folder)
    spec = task.spec | {"seed": seed}
    ds, m, job_id = spec["dataset"], spec["model"], next(_job_ids)
    data = load_dataset(ds["source"], ds["validation_fraction"], ds["classes"])
    config = model_config(m, data)
    server = state_to_numpy(build_model(m["name"], data.input_shape, data.num_classes, seed=seed, **m["options"]))
    rule, policy = make_rule(spec["assimilation"]), Policy.from_spec(spec["assimilation"])
    state = rule.initial_state(server)
    defaults = ValidationSpec()
    hx, hy = data.x_val[: defaults.holdout_examples], data.y_val[: defaults.holdout_examples]
    shards = deal_shards(data.y, ds["subsets"], ds["shuffle"], seed)
    history = deque([{k: v.copy() for k, v in server.items()}], maxlen=slots)
    rng = np.random.default_rng(seed)
    honest, held_out, forged = [], [], {s: [] for s in FORGED_SCALES}
    reached, merges, accuracy = None, 0, 0.0
    for epoch in range(1, max_epochs + 1):
        for shard in shards:
            base = history[0]  # the oldest of `slots` concurrent hosts' bases: staleness slots - 1
            x, y = data.x[shard], data.y[shard]
            recipe = {"model": config, "training": spec["training"], "seed": seed * 10_000 + merges}
            client = train(recipe, base, x, y).params
            ex, ey = x[: defaults.training_examples], y[: defaults.training_examples]
            honest.append(evidence_of(job_id, config, base, client, ex, ey, rng))
            for scale in FORGED_SCALES:
                forged_result = colluding_pair(base, client, scale, rng)
                forged[scale].append(evidence_of(job_id, config, base, forged_result, ex, ey, rng))
            delta = {k: client[k] - base[k] for k in floats(client)}
            update = Update(client=client, delta=delta, staleness=slots - 1, epoch=epoch)
            held_out.append(z_on(job_id, config, server, merged_alone(policy, rule, server, state, update), hx, hy))
            rule.apply(server, state, update)
            merges += 1
            history.append({k: v.copy() for k, v in server.items()})
            accuracy = evaluate(job_id, config, server, data.x_val, data.y_val, framework="pytorch")[1]
            if accuracy >= task.target and reached is None:
                reached = merges
        z_min, descent_min = np.min(honest, axis=0)
        progress = f"accuracy {accuracy:.3f}, z >= {z_min:.1f}, descent z >= {descent_min:.1f}"
        say(f"{name} seed {seed}: epoch {epoch}, {merges} merges, {progress}")
        if reached is not None:
            break
    return {
        "task": name,
        "seed": seed,
        "target": task.target,
        "merges_to_target": reached,
        "honest_z": honest,
        "held_out_z": held_out,
        "forged_z": {str(s): v for s, v in forged.items()},
    }


def summarize(runs: list[dict], checks: ValidationSpec) -> dict:
    """Per task: the honest results' evidence, false refusals and catch rates at the job-spec defaults
    (training z alone, and with the descent z: what the vote requires)."""
    out = {}
    for task in sorted({r["task"] for r in runs}):
        mine = [r for r in runs if r["task"] == task]
        honest = np.concatenate([r["honest_z"] for r in mine])  # rows: (training z, descent z)
        held_out = np.concatenate([r["held_out_z"] for r in mine])
        forged = {s: np.concatenate([r["forged_z"][str(s)] for r in mine]) for s in FORGED_SCALES}

        def refused(rows: np.ndarray) -> np.ndarray:
            return np.array([untrained(z, descent, checks) is not None for z, descent in rows])

        out[task] = {
            "honest_results": len(honest),
            "reached_target": all(r["merges_to_target"] is not None for r in mine),
            "honest_z_min": round(float(honest[:, 0].min()), 2),
            "honest_z_p01": round(float(np.percentile(honest[:, 0], 1)), 2),
            "honest_z_median": round(float(np.median(honest[:, 0])), 2),
            "honest_descent_z_min": round(float(honest[:, 1].min()), 2),
            "honest_descent_z_median": round(float(np.median(honest[:, 1])), 2),
            "false_refusal_rate": float(np.mean(refused(honest))),
            "forged_z_max": {str(s): round(float(v[:, 0].max()), 2) for s, v in forged.items()},
            "forged_descent_z_max": {str(s): round(float(v[:, 1].max()), 2) for s, v in forged.items()},
            "catch_rate_training_z_alone": {
                str(s): float(np.mean(v[:, 0] < checks.min_training_z)) for s, v in forged.items()
            },
            "catch_rate": {str(s): float(np.mean(refused(v))) for s, v in forged.items()},
            "held_out_z_min": round(float(held_out.min()), 2),
            "held_out_false_refusal_rate": float(np.mean(held_out < HELD_OUT_THRESHOLD)),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="mnist1d,tabular", help="comma-separated, of mnist1d, tabular")
    parser.add_argument("--seeds", type=int, default=1, help="runs per task, seeds 0..N-1")
    parser.add_argument("--slots", type=int, default=4, help="concurrent hosts: results are slots-1 merges stale")
    parser.add_argument("--max-epochs", type=int, default=40, help="epochs a run may take to reach its target")
    args = parser.parse_args()
    limit_threads(1)
    checks = ValidationSpec()
    assert checks.min_training_z is not None and checks.min_descent_z is not None
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
                runs.append(run_task(task, Path(tmp), seed, args.slots, args.max_epochs))
    summary = summarize(runs, checks)
    for task, row in summary.items():
        say(f"{task}: {row}")
    figures = {
        "benchmark": "replica_improvement",
        "min_training_z": checks.min_training_z,
        "min_descent_z": checks.min_descent_z,
        "training_z_alone": checks.training_z_alone,
        "held_out_threshold": HELD_OUT_THRESHOLD,
        "slots": args.slots,
        "seeds": args.seeds,
        "summary": summary,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    sys.exit(main())
