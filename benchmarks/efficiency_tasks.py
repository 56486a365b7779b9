"""The tasks and merge-rule configurations that benchmarks/learning_efficiency.py measures, and the
job spec it submits for each run. Not a benchmark of its own: learning_efficiency.py imports it."""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError

from crowdtrain.assimilator.rules import make_rule
from crowdtrain.core.jobspec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = ROOT / "examples" / "mnist1d-cnn.yaml"
DEFAULT_RULE = "default"

# Named assimilation sections (fields of crowdtrain.core.jobspec.AssimilationSpec). `default` is filled
# in from EXAMPLE_SPEC. Add a configuration here and it is benchmarked; one the code does not
# know yet is reported "unsupported".
RULE_CONFIGS: dict[str, dict] = {
    "default": {},
    "vc-asgd": {"rule": "vc-asgd", "schedule": "constant", "alpha": 0.6},
    "delta": {"rule": "delta", "server_lr": 0.2, "staleness_weight": "constant"},
    "delta-poly": {"rule": "delta", "server_lr": 0.5, "staleness_weight": "polynomial", "staleness_a": 0.5},
    "fedbuff": {"rule": "fedbuff", "buffer_size": 2, "combiner": "mean", "server_lr": 0.5},
    "fedbuff-median": {"rule": "fedbuff", "buffer_size": 3, "combiner": "median", "server_lr": 0.5},
    "delta+nesterov": {"rule": "delta", "outer_optimizer": "nesterov", "server_lr": 0.1, "outer_momentum": 0.5},
    "fedbuff+nesterov": {
        "rule": "fedbuff",
        "buffer_size": 2,
        "outer_optimizer": "nesterov",
        "server_lr": 0.2,
        "outer_momentum": 0.5,
    },
    "delta+delayed-nesterov": {
        "rule": "delta",
        "outer_optimizer": "delayed-nesterov",
        "server_lr": 0.4,
        "outer_momentum": 0.5,
        "nesterov_delay": 4,
    },
    "delta+adam": {
        "rule": "delta",
        "outer_optimizer": "adam",
        "server_lr": 0.01,
        "adam_betas": [0.5, 0.9],
        "staleness_weight": "polynomial",
        "staleness_a": 0.5,
    },
    "delta-bf16": {"rule": "delta", "server_lr": 0.2, "upload": {"send": "delta", "dtype": "bfloat16"}},
    "delta-int8": {"rule": "delta", "server_lr": 0.2, "upload": {"send": "delta", "dtype": "int8"}},
}


@dataclass(frozen=True)
class Task:
    name: str
    spec: dict  # a job spec (JSON form) whose assimilation section the rule configuration replaces
    target: float
    budget_passes: int  # the baseline's passes over the training set


def tabular_arrays(
    seed: int = 0,
    n_train: int = 4000,
    n_val: int = 1000,
    classes: int = 5,
    features: int = 24,
    latent: int = 8,
    clusters: int = 8,
    spread: float = 2.5,
    noise: float = 0.2,
) -> dict:
    """A 5-class tabular task, deterministic in `seed`: each class is a mixture of `clusters`
    Gaussians in a `latent`-dimensional space, seen through a random linear map followed by sin
    (even features) or tanh (odd features), plus noise. One MLP process reaches about 0.91."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, spread, size=(classes, clusters, latent))
    mixing = rng.normal(size=(latent, features)) / np.sqrt(latent)
    freq = rng.uniform(0.5, 1.5, size=features)
    even = np.arange(features) % 2 == 0

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, classes, n)
        h = (means[y, rng.integers(0, clusters, n)] + rng.normal(size=(n, latent))) @ mixing
        x = 2.0 * np.where(even, np.sin(freq * h), np.tanh(h)) + noise * rng.normal(size=(n, features))
        return x.astype(np.float32), y.astype(np.int64)

    x, y = draw(n_train)
    x_val, y_val = draw(n_val)
    return {"x": x, "y": y, "x_val": x_val, "y_val": y_val}


def example_spec() -> dict:
    return JobSpec.model_validate(yaml.safe_load(EXAMPLE_SPEC.read_text())).model_dump(mode="json")


def make_task(name: str, folder: Path, budget_passes: int | None = None) -> Task:
    """The task `name` ('mnist1d' or 'tabular'); the tabular data is written to `folder`."""
    budget = budget_passes or 12
    base = example_spec()
    if name == "mnist1d":
        return Task("mnist1d", base, base["stop"]["target_accuracy"], budget)
    if name == "tabular":
        path = folder / "tabular.npz"
        np.savez(path, **tabular_arrays(0))
        spec = base | {
            "name": "tabular-mlp",
            "model": {"name": "mlp", "options": {"hidden": [64, 64]}},
            "dataset": {"source": f"npz:{path.resolve()}", "subsets": 4},
            "training": base["training"] | {"lr": 0.001},
        }
        return Task("tabular", JobSpec.model_validate(spec).model_dump(mode="json"), 0.88, budget)
    raise ValueError(f"--tasks: unknown task {name!r}; known: mnist1d, tabular")


def assimilation_for(rule: str) -> dict:
    """The assimilation section of rule configuration `rule` (`default`: the example job's)."""
    if rule not in RULE_CONFIGS:
        raise ValueError(f"--rules: unknown rule configuration {rule!r}; known: {', '.join(RULE_CONFIGS)}")
    return example_spec()["assimilation"] if rule == DEFAULT_RULE else RULE_CONFIGS[rule]


def epoch_budget(task: Task, args) -> int:
    """The system's budget: `--system-budget` times the baseline's examples, in job epochs
    (one epoch trains every shard `local_epochs` times)."""
    return math.ceil(task.budget_passes * args.system_budget / task.spec["training"]["local_epochs"])


def job_spec(task: Task, rule: str, seed: int, max_epochs: int, stop_at_target: bool) -> dict:
    """The job to submit: the task's spec with the rule's assimilation section and this run's stop rule."""
    target = task.target if stop_at_target else 1.0  # 1.0: run the whole budget, the target is read here
    return task.spec | {
        "name": f"efficiency-{task.name}-{rule}-s{seed}",
        "seed": seed,
        "assimilation": assimilation_for(rule),
        "stop": {"target_accuracy": target, "max_epochs": max_epochs},
    }


def unsupported_reason(spec: dict) -> str | None:
    """Why this code cannot run `spec`'s merge rule (None when it can): the spec is refused, or
    the rule registry does not know the rule."""
    try:
        stored = JobSpec.model_validate(spec).model_dump(mode="json")
    except ValidationError as exc:
        return "spec refused: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    try:
        make_rule(stored["assimilation"])
    except (ValueError, KeyError, NotImplementedError) as exc:
        return f"merge rule: {exc}"
    return None
