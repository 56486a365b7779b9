"""The tasks and merge-rule configurations that benchmarks/learning_efficiency.py measures, and the
job spec it submits for each run. Not a benchmark of its own: learning_efficiency.py imports it.

A task is a YAML file of benchmarks/tasks/ (`TaskFile`): a job spec, the generator of its data
(efficiency_data.GENERATORS) and that generator's parameters, a target accuracy and a budget."""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from crowdtrain.assimilator.rules import make_rule
from crowdtrain.core.jobspec import JobSpec, load_job_spec
from crowdtrain.core.specfile import load_yaml
from efficiency_data import GENERATORS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = ROOT / "examples" / "mnist1d-cnn.yaml"
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
MAX_LR = 10.0  # crowdtrain.core.jobspec.TrainingSpec.lr's bound
DEFAULT_RULE = "default"

# Named assimilation sections (fields of crowdtrain.core.assimilationspec.AssimilationSpec). `default` is filled
# in from EXAMPLE_SPEC. Add a configuration here and it is benchmarked; one the code does not
# know yet is reported "unsupported".
ROUND_SIZE = "slots"  # a rule configuration's buffer_size that asks for rounds of the run's slot count
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
    # Staleness-aware step sizes (Zhang et al. 2016, "Staleness-aware Async-SGD"): η / (1 + τ).
    "delta-1-poly1": {"rule": "delta", "server_lr": 1.0, "staleness_weight": "polynomial", "staleness_a": 1.0},
    "delta-0.3": {"rule": "delta", "server_lr": 0.3, "staleness_weight": "constant"},
    "delta-poly-1": {"rule": "delta", "server_lr": 1.0, "staleness_weight": "polynomial", "staleness_a": 0.5},
    # AdaScale's gain over the update stream (crowdtrain.assimilator.rules.gain): r(1+τ)/(1+τ) per update.
    "delta-gain": {"rule": "delta", "server_lr": 1.0, "staleness_weight": "gain"},
    # The per-result (1+τ)^-0.5 step scaled by a factor that follows the validation loss
    # (crowdtrain.assimilator.rules.control): from 1/16, x1.1 at each new lowest loss, halved at a rise.
    "delta-poly-loss": {
        "rule": "delta",
        "server_lr": 1.0,
        "staleness_weight": "polynomial",
        "staleness_a": 0.5,
        "step_control": "loss",
    },
    "delta-loss": {"rule": "delta", "server_lr": 1.0, "staleness_weight": "constant", "step_control": "loss"},
    # One outer step per 8 results, their mean scaled by sqrt(8) (the square-root rule of large batches).
    "fedbuff-8-sqrt": {"rule": "fedbuff", "buffer_size": 8, "combiner": "mean", "server_lr": 2.83},
    "delta-bf16": {"rule": "delta", "server_lr": 0.2, "upload": {"send": "delta", "dtype": "bfloat16"}},
    "delta-int8": {"rule": "delta", "server_lr": 0.2, "upload": {"send": "delta", "dtype": "int8"}},
    # Semi-synchronous rounds (scheduling.rounds, crowdtrain.core.rounds): one round per `slots` results
    # that all start from one W_s, their mean applied by DiLoCo's outer Nesterov (Douillard et al. 2023:
    # learning rate 0.7, momentum 0.9). ROUND_SIZE is replaced by the run's slot count.
    "rounds": {
        "rule": "fedbuff",
        "buffer_size": ROUND_SIZE,
        "combiner": "mean",
        "outer_optimizer": "nesterov",
        "server_lr": 0.7,
        "outer_momentum": 0.9,
    },
}
# The same rounds with other outer learning rates (docs/benchmarks.md, "Semi-synchronous rounds").
RULE_CONFIGS |= {f"rounds-{lr}": RULE_CONFIGS["rounds"] | {"server_lr": lr} for lr in (0.2, 0.35, 0.5, 1.4, 2.8)}


@dataclass(frozen=True)
class Task:
    name: str
    spec: dict  # a job spec (JSON form) whose assimilation section the rule configuration replaces
    target: float
    budget_passes: int  # the baseline's passes over the training set
    eval_fraction: float = 0.001  # the baseline evaluates W every this fraction of its budget


class TaskData(BaseModel):
    """Where a task's training data comes from: a generator of efficiency_data.GENERATORS, its seed
    and keyword parameters; its arrays become the job's `dataset.source` (an npz file)."""

    model_config = ConfigDict(extra="forbid")
    generator: str
    seed: int = 0
    params: dict[str, Any] = Field(default_factory=dict)


class TaskFile(BaseModel):
    """A task file, benchmarks/tasks/NAME.yaml: the job spec (`job`, on top of the spec file named by
    `extends`, relative to the task file, section by section), where its data comes from (`data`;
    none for a built-in `dataset.source`), the target validation accuracy, the single process's
    budget in passes over the training set and how often it evaluates W (a fraction of the budget:
    fine enough to locate the target within 2% of its examples, coarse enough to cost little)."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None  # default: the file's stem
    target_accuracy: float = Field(gt=0, le=1)
    budget_passes: int = Field(12, ge=1, le=1000)
    eval_fraction: float = Field(0.001, gt=0, le=0.1)
    extends: str | None = None
    job: dict[str, Any] = Field(default_factory=dict)
    data: TaskData | None = None


def task_path(ref: str) -> Path:
    """The file of `--tasks` entry `ref`: a name of benchmarks/tasks/ or a path to a YAML file."""
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        return Path(ref)
    return TASKS_DIR / f"{ref}.yaml"


def known_tasks() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def _fields(exc: ValidationError, prefix: str = "") -> str:
    return "; ".join(f"{prefix}{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors())


def read_task_file(ref: str) -> tuple[Path, TaskFile, dict]:
    """The task file of `ref`, checked, and its job spec before the data is made: raises ValueError
    naming the file and the bad field."""
    path = task_path(ref)
    if not path.is_file():
        raise ValueError(f"--tasks: no task {ref!r} ({path} is not a file); known: {', '.join(known_tasks())}")
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a task file is a mapping, got {type(raw).__name__}")
    try:
        task = TaskFile.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{path}: {_fields(exc)}") from None
    spec: dict = {}
    if task.extends is not None:
        base_path = path.parent / task.extends
        if not base_path.is_file():
            raise ValueError(f"{path}: extends: {base_path} is not a file")
        spec = load_yaml(base_path)
    for section, value in task.job.items():
        both = isinstance(spec.get(section), dict) and isinstance(value, dict)
        spec[section] = spec[section] | value if both else value
    if task.data is not None and task.data.generator not in GENERATORS:
        raise ValueError(
            f"{path}: data.generator: unknown generator {task.data.generator!r}; known: {', '.join(GENERATORS)}"
        )
    return path, task, spec


def make_task(ref: str, folder: Path, budget_passes: int | None = None) -> Task:
    """The task of `ref` (see `task_path`); a generated dataset is written to `folder`. Raises
    ValueError naming the file and the field when the file, its job spec or its data is bad."""
    path, task, spec = read_task_file(ref)
    name = task.name or path.stem
    if task.data is not None:
        try:
            arrays = GENERATORS[task.data.generator](task.data.seed, **task.data.params)
        except TypeError as exc:
            raise ValueError(f"{path}: data.params: {exc}") from None
        npz = folder / f"{name}.npz"
        np.savez(npz, x=arrays["x"], y=arrays["y"], x_val=arrays["x_val"], y_val=arrays["y_val"])
        spec["dataset"] = (spec.get("dataset") or {}) | {"source": f"npz:{npz.resolve()}"}
    try:
        checked = JobSpec.model_validate(spec).model_dump(mode="json")
    except ValidationError as exc:
        raise ValueError(f"{path}: {_fields(exc, 'job.')}") from None
    return Task(name, checked, task.target_accuracy, budget_passes or task.budget_passes, task.eval_fraction)


def example_spec() -> dict:
    return load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")


def assimilation_for(rule: str) -> dict:
    """The assimilation section of rule configuration `rule` (`default`: the example job's)."""
    if rule not in RULE_CONFIGS:
        raise ValueError(f"--rules: unknown rule configuration {rule!r}; known: {', '.join(RULE_CONFIGS)}")
    return example_spec()["assimilation"] if rule == DEFAULT_RULE else RULE_CONFIGS[rule]


def bound_lrs(lr: float, slots: int) -> list[float]:
    """The large-batch bound's learning rates at `slots` slots: the job's `lr` times 1, sqrt(slots)
    and slots (the square-root and linear scaling rules), each at most the job spec's limit of 10."""
    return sorted({min(MAX_LR, lr * m) for m in (1.0, math.sqrt(slots), float(slots))})


def epoch_budget(task: Task, args) -> int:
    """The system's budget: `--system-budget` times the baseline's examples, in job epochs
    (one epoch trains every shard `local_epochs` times)."""
    return math.ceil(task.budget_passes * args.system_budget / task.spec["training"]["local_epochs"])


def job_spec(
    task: Task,
    rule: str,
    seed: int,
    max_epochs: int,
    stop_at_target: bool,
    snapshot_binding: str | None = None,
    slots: int = 1,
) -> dict:
    """The job to submit: the task's spec with the rule's assimilation section and this run's stop rule,
    and `snapshot_binding` (scheduling.snapshot_binding) when given, else the task's. A rule in rounds
    (buffer_size ROUND_SIZE) gets rounds of `slots` results."""
    target = task.target if stop_at_target else 1.0  # 1.0: run the whole budget, the target is read here
    scheduling = task.spec.get("scheduling", {}) | ({"snapshot_binding": snapshot_binding} if snapshot_binding else {})
    assimilation = assimilation_for(rule)
    if assimilation.get("buffer_size") == ROUND_SIZE:
        assimilation = assimilation | {"buffer_size": slots}
        scheduling = scheduling | {"rounds": True}
    return task.spec | {
        "name": f"efficiency-{task.name}-{rule}-s{seed}",
        "seed": seed,
        "assimilation": assimilation,
        "stop": {"target_accuracy": target, "max_epochs": max_epochs},
        "scheduling": scheduling,
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
