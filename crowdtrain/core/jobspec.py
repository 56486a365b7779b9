"""The job spec: what an operator submits (YAML or JSON), validated with clear errors. Its dataset,
model, validation and dedloc sections have modules of their own (crowdtrain.core.datasetspec,
crowdtrain.core.modelspec, crowdtrain.core.validationspec, crowdtrain.core.dedlocspec)."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import Field, model_validator

from crowdtrain.core.datasetspec import DatasetSpec, resolve_relative_source
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.frameworks import KERAS_MODEL, ZOO_PORTS, Framework
from crowdtrain.core.modelspec import MAX_KERAS_JSON_BYTES, ModelSpec
from crowdtrain.core.specfile import SpecFileError, SpecSection, load_yaml, read_bounded
from crowdtrain.core.validationspec import ValidationSpec

VC_ASGD: Final = "vc-asgd"  # asynchronous data-parallel: epochs of workunits whose results are merged
DEDLOC: Final = "dedloc"  # synchronous rounds of peers (crowdtrain.server.services.dedloc); never workunits
# Expert-parallel (Learning@home): workunits train the dense trunk, merged as in vc-asgd, while its
# mixture-of-experts layers are served by expert hosts (crowdtrain.core.experts)
MOE: Final = "moe"
WORKUNIT_MODES: Final = (VC_ASGD, MOE)  # the modes whose work is epochs of workunits


class TrainingSpec(SpecSection):
    local_epochs: int = Field(1, ge=1, le=1000)
    batch_size: int = Field(32, ge=1, le=65536)
    optimizer: Literal["sgd", "adam"] = "adam"
    lr: float = Field(0.001, gt=0, le=10)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    dynamic_local_work: bool = Field(
        False,
        description="Scale each host's local steps with its measured speed, "
        "so that slow hosts' updates are about as stale as fast "
        "hosts' (Async Local-SGD's dynamic local updates)",
    )
    min_local_fraction: float = Field(
        0.25,
        gt=0,
        le=1,
        description="With dynamic_local_work: the fewest local steps, as a fraction of local_epochs' steps",
    )
    keep_optimizer_state: bool = Field(
        False,
        description="Each compute slot of a client keeps its optimizer's state (Adam moments and step, SGD "
        "momentum) from one workunit of the job to the next, instead of starting every workunit from zero. "
        "Costs client memory per slot (Adam 2x the parameters, SGD momentum 1x). Simulated on mnist1d with "
        "short workunits (32 shards x 1 local epoch), 8 slots needed 18-43% fewer examples with Adam and 70% "
        "fewer with SGD+momentum, reaching the large-batch bound",
    )


class UploadSpec(SpecSection):
    """What a client sends back: its weights W_c, or its update Δ = W_c − W_base, encoded."""

    send: Literal["weights", "delta"] = "weights"
    dtype: Literal["float32", "bfloat16", "int8"] = Field(
        "float32", description="Encoding of Δ (weights are always float32)"
    )
    block_size: int | None = Field(
        None, ge=16, le=1 << 24, description="int8: one scale per this many values (null: one per tensor)"
    )

    @model_validator(mode="after")
    def _weights_are_float32(self) -> "UploadSpec":
        if self.send == "weights" and self.dtype != "float32":
            raise ValueError(
                f"assimilation.upload.dtype {self.dtype!r} needs send: delta (weights are sent as float32)"
            )
        if self.block_size is not None and self.dtype != "int8":
            raise ValueError("assimilation.upload.block_size applies to dtype int8 only")
        return self


MERGE_RULES = ("vc-asgd", "delta", "fedbuff")
OUTER_OPTIMIZERS = ("none", "nesterov", "delayed-nesterov", "adam")


# The assimilation a job gets when its spec names no rule: the configuration that scored best over the
# benchmark suite among those that do not need the slot count (benchmarks/choosing_table.py; the
# ranking is in docs/operator/choosing-a-mode.md). A spec that names a rule gets that rule with the
# fields' own defaults.
DEFAULT_ASSIMILATION: dict[str, Any] = {
    "rule": "delta",
    "server_lr": 1.0,
    "staleness_weight": "polynomial",
    "staleness_a": 0.5,
    "step_control": "loss",
}


# Fields that only one rule reads: given without a rule, they would silently do nothing.
_OWN_FIELDS: dict[str, tuple[str, ...]] = {
    "vc-asgd": ("alpha", "schedule"),
    "fedbuff": ("buffer_size", "combiner", "trim_fraction"),
}


class AssimilationSpec(SpecSection):
    rule: Literal["vc-asgd", "delta", "fedbuff"] = Field(
        DEFAULT_ASSIMILATION["rule"],
        description="vc-asgd: W_s <- a*W_s + (1-a)*W_c; delta: W_s <- W_s + server_lr * s(tau) * Δ; "
        "fedbuff: buffer buffer_size updates, combine, apply once. A section without a rule gets the "
        "default configuration: delta, server_lr 1, staleness_weight polynomial (staleness_a 0.5), "
        "step_control loss (crowdtrain.core.jobspec.DEFAULT_ASSIMILATION), its other fields as given",
    )
    server_lr: float = Field(
        1.0,
        gt=0,
        le=100,
        description="delta/fedbuff: the server step η on the (combined) update, or the outer optimizer's learning rate",
    )
    staleness_weight: Literal["constant", "polynomial", "hinge", "gain"] = Field(
        "constant",
        description="delta/fedbuff: s(tau) = 1; (1+tau)^-staleness_a; or 1 for tau <= staleness_b, "
        "else 1/(staleness_a*(tau-staleness_b)+1) (FedAsync); delta only: gain, r(1+tau)/(1+tau) with "
        "AdaScale's gain r estimated from the updates' noise (crowdtrain.assimilator.rules.gain)",
    )
    step_control: Literal["none", "loss"] = Field(
        "none",
        description="delta/fedbuff: none, or loss: the step scaled by c, which starts at step_floor, grows "
        "x1.1 at each evaluation whose validation loss is below the previous one (to 1) and halves at one more "
        "than 5% above it (to step_floor): a step that follows what the task tolerates "
        "(crowdtrain.assimilator.rules.control)",
    )
    step_floor: float = Field(0.0625, gt=0, le=1, description="step_control loss: the smallest (and first) c")
    staleness_a: float = Field(0.5, ge=0, le=100)
    staleness_b: int = Field(4, ge=0, le=1_000_000)
    buffer_size: int = Field(4, ge=1, le=1024, description="fedbuff: updates combined per step of W_s")
    combiner: Literal["mean", "median", "trimmed-mean"] = Field(
        "mean", description="fedbuff: how buffered updates combine (median and trimmed-mean resist outliers)"
    )
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="fedbuff trimmed-mean: fraction cut at each end")
    outer_optimizer: Literal["none", "nesterov", "delayed-nesterov", "adam"] = Field(
        "none",
        description="delta/fedbuff: an optimizer over the combined update taken as a pseudo-gradient: "
        "SGD with Nesterov momentum (DiLoCo), delayed Nesterov (Async Local-SGD), or Adam "
        "with staleness-gated input",
    )
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov_delay: int = Field(4, ge=1, le=1024, description="delayed-nesterov: updates between momentum steps")
    adam_betas: tuple[float, float] = Field((0.9, 0.99))
    adam_eps: float = Field(1e-8, gt=0)
    clip_norm: float | None = Field(None, gt=0, description="Scale any update whose norm is above this down to it")
    upload: UploadSpec = Field(default_factory=UploadSpec)
    schedule: Literal["constant", "epoch"] = Field("constant", description="constant alpha, or alpha_e = e/(e+1)")
    alpha: float = Field(
        0.6,
        ge=0,
        lt=1,
        description="vc-asgd: W_s keeps this share of itself at each merge",
    )
    max_staleness: int | None = Field(None, ge=0, description="Reject results whose base is this many versions old")
    max_update_norm: float | None = Field(
        None,
        gt=0,
        description="Reject results whose update ||W_c - W_base|| "
        "(against the snapshot the host started from) "
        "is above this",
    )
    update_norm_factor: float | None = Field(
        10.0,
        gt=1,
        description="Reject results whose update ||W_c - W_base|| exceeds this many times the median "
        "norm of the job's recently accepted updates (or, until update_norm_warmup updates "
        "are accepted, this many times max(||W_base||, 1)); null turns the relative bound "
        "off. Honest updates of one job vary by a factor of 2-3; a hostile one is larger",
    )
    update_norm_warmup: int = Field(
        5, ge=1, le=1000, description="Accepted updates needed before the bound follows their median"
    )
    divergence_factor: float | None = Field(
        3.0,
        gt=1,
        le=1e6,
        description="The job fails as diverged when W_s's last divergence_patience validation losses are all "
        "above this many times its lowest so far (or not finite): the rule's steps overshoot, and merging more "
        "makes it worse; null: never",
    )
    divergence_patience: int = Field(3, ge=1, le=1000, description="Evaluations in a row that show divergence")
    min_update_spread: float | None = Field(
        1e-6,
        ge=0,
        lt=1,
        description="Reject results whose update carries no training: every tensor of W_c - W_base zero or "
        "constant, its values spread (max - min) over at most this fraction of the tensor's largest weight "
        "(never less than the dtype's rounding); null accepts them",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_configuration(cls, data: Any) -> Any:
        """A section that names no rule starts from DEFAULT_ASSIMILATION; what it sets wins."""
        if not isinstance(data, dict) or "rule" in data:
            return data
        for rule, fields in _OWN_FIELDS.items():
            named = sorted(set(fields) & set(data))
            if named and rule != DEFAULT_ASSIMILATION["rule"]:
                raise ValueError(
                    f"assimilation.{named[0]} is a {rule} setting, and a section without a rule gets the default "
                    f"({DEFAULT_ASSIMILATION['rule']}): add `rule: {rule}`"
                )
        return DEFAULT_ASSIMILATION | data

    @model_validator(mode="after")
    def _options_of_the_rule(self) -> "AssimilationSpec":
        if self.rule == "vc-asgd" and self.outer_optimizer != "none":
            raise ValueError(
                f"assimilation.outer_optimizer {self.outer_optimizer!r} needs rule delta or fedbuff "
                "(vc-asgd mixes weights; it has no update to optimize)"
            )
        if any(not 0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"assimilation.adam_betas must lie in [0, 1), got {list(self.adam_betas)}")
        if self.step_control != "none" and self.rule == "vc-asgd":
            raise ValueError("assimilation.step_control needs rule delta or fedbuff (vc-asgd takes no step)")
        if self.staleness_weight == "gain" and self.rule != "delta":
            raise ValueError(f"assimilation.staleness_weight gain needs rule delta, not {self.rule}")
        return self


def _steps(a: "AssimilationSpec") -> bool:
    return a.rule != "vc-asgd"


# The options a merge rule reads, in the order they are shown, each with when it is read.
_READ_WHEN: tuple[tuple[str, Callable[["AssimilationSpec"], bool]], ...] = (
    ("schedule", lambda a: a.rule == "vc-asgd"),
    ("alpha", lambda a: a.rule == "vc-asgd" and a.schedule == "constant"),
    ("server_lr", _steps),
    ("staleness_weight", _steps),
    ("staleness_a", lambda a: _steps(a) and a.staleness_weight in ("polynomial", "hinge")),
    ("staleness_b", lambda a: _steps(a) and a.staleness_weight == "hinge"),
    ("buffer_size", lambda a: a.rule == "fedbuff"),
    ("combiner", lambda a: a.rule == "fedbuff"),
    ("trim_fraction", lambda a: a.rule == "fedbuff" and a.combiner == "trimmed-mean"),
    ("outer_optimizer", lambda a: _steps(a) and a.outer_optimizer != "none"),
    ("outer_momentum", lambda a: _steps(a) and a.outer_optimizer in ("nesterov", "delayed-nesterov")),
    ("nesterov_delay", lambda a: _steps(a) and a.outer_optimizer == "delayed-nesterov"),
    ("adam_betas", lambda a: _steps(a) and a.outer_optimizer == "adam"),
    ("step_control", _steps),
    ("step_floor", lambda a: _steps(a) and a.step_control != "none"),
    ("clip_norm", lambda a: a.clip_norm is not None),
    ("max_staleness", lambda a: a.max_staleness is not None),
)


def effective_rule(a: AssimilationSpec) -> str:
    """The merge rule a job runs with and the options it reads, defaults included, in one line (the
    scheduler logs it when the job is created): what a spec left out is shown, not guessed."""
    shown = ", ".join(f"{name} {getattr(a, name)}" for name, read in _READ_WHEN if read(a))
    return f"{a.rule} ({shown})"


class StopSpec(SpecSection):
    target_accuracy: float = Field(..., gt=0, le=1)
    max_epochs: int = Field(50, ge=1, le=100_000)
    max_steps: int | None = Field(
        None, ge=1, le=10_000_000, description="dedloc mode: stop after this many global optimizer steps"
    )


class SchedulingSpec(SpecSection):
    deadline_seconds: float = Field(120, gt=0)
    max_errors: int = Field(3, ge=1)
    eval_every: int = Field(1, ge=1, description="Evaluate W_s on the validation set every N merges")
    snapshot_every_merges: int = Field(1, ge=1)
    snapshot_every_seconds: float = Field(5.0, ge=0)
    weight: float = Field(
        1.0,
        ge=0.01,
        le=100,
        description="Fair share between running jobs: each job's share of the running assignments "
        "is proportional to its weight (2 gets twice the hosts of 1)",
    )
    lease_max_factor: float = Field(
        4.0,
        ge=1,
        le=100,
        description="Each heartbeat extends an assignment's deadline to now + deadline_seconds, "
        "never past sent + lease_max_factor x deadline_seconds (1: heartbeats never extend it)",
    )
    duplicate_after_seconds: float | None = Field(
        30.0,
        ge=0,
        le=86_400,
        description="When the job has nothing else to give, an idle host may get a duplicate of the "
        "oldest assignment running at least this long (the first valid result wins); null: never",
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Backpressure: the most assignments of the job dispatched or uploaded but not yet merged "
        "(prefetched ones included); at it, dispatch gives the job no new workunit, serving other jobs, until "
        "merges land. null: derived from the merge pace measured over the latest merges, max(rule floor, "
        "ceil(merges per second x median dispatch-to-upload seconds) + hosts holding the job's work), the rule "
        "floor being assimilation.buffer_size for fedbuff, else 1 (no budget before two merges measure the pace)",
    )
    snapshot_binding: Literal["dispatch", "start"] = Field(
        "dispatch",
        description="Which W_s snapshot an assignment trains from: the one published when it was dispatched, or "
        "(start) the newest when the host's compute slot starts it; a prefetched assignment then does not age "
        "while it waits for a slot. Replicated work always keeps its dispatched snapshot",
    )
    rounds: bool = Field(
        False,
        description="Semi-synchronous rounds (rule fedbuff): every workunit of a round trains from the same W_s; "
        "dispatch opens at most assimilation.buffer_size of them (prefetched ones included) and the next round "
        "only once the buffer's outer step has made and published the new W_s. Snapshots are published and W_s "
        "evaluated (every eval_every rounds) at the rounds' ends. Replaces max_in_flight",
    )


def scheduling_of(spec: dict[str, Any]) -> SchedulingSpec:
    """The scheduling section of a stored job spec, with the defaults of fields added since it was stored."""
    return SchedulingSpec.model_validate(spec.get("scheduling", {}))


class JobSpec(SpecSection):
    name: str = Field(..., min_length=1, max_length=200)
    mode: Literal["vc-asgd", "dedloc", "moe"] = VC_ASGD
    framework: Framework = Field(
        "pytorch",
        description="The framework the job is written for; clients with another framework that "
        "ports the zoo model may train it too (the parameter layout is shared)",
    )
    seed: int = 0
    model: ModelSpec
    dataset: DatasetSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    assimilation: AssimilationSpec = Field(default_factory=AssimilationSpec)
    stop: StopSpec
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    dedloc: DedlocSpec | None = Field(None, description="Required in dedloc mode, refused otherwise")
    experts: ExpertLayout | None = Field(
        None,
        description="Required in moe mode, refused otherwise: the mixture-of-experts layers served by expert "
        "hosts, their optimizer and checkpoints, and how trainers call them",
    )

    @model_validator(mode="after")
    def _mode_sections(self) -> "JobSpec":
        if self.mode == "dedloc":
            if self.dedloc is None:
                raise ValueError("mode 'dedloc' needs a 'dedloc' section (target_batch_size, ...)")
            if self.stop.max_steps is None:
                raise ValueError("mode 'dedloc' needs stop.max_steps")
            if self.model.name == "resnet":
                # BatchNorm running statistics are per-peer state that gradient averaging does not
                # synchronise: peers' parameters would drift apart.
                raise ValueError("mode 'dedloc' supports models without BatchNorm (mlp, cnn1d), not 'resnet'")
            if self.framework != "pytorch":
                raise ValueError("mode 'dedloc' peers train with PyTorch: use framework 'pytorch'")
        elif self.dedloc is not None:
            raise ValueError(f"a 'dedloc' section is only allowed with mode 'dedloc', not {self.mode!r}")
        if self.scheduling.rounds and self.assimilation.rule != "fedbuff":
            raise ValueError(
                "scheduling.rounds needs assimilation.rule 'fedbuff' (a round is its buffer: buffer_size results "
                f"combined in one outer step), not {self.assimilation.rule!r}"
            )
        if self.scheduling.rounds and self.scheduling.max_in_flight is not None:
            raise ValueError(
                "scheduling.rounds sets the in-flight budget (assimilation.buffer_size): drop max_in_flight"
            )
        if self.mode != DEDLOC and self.stop.max_steps is not None:
            raise ValueError(f"stop.max_steps applies to mode 'dedloc'; {self.mode} stops at stop.max_epochs")
        return self

    @model_validator(mode="after")
    def _moe_sections(self) -> "JobSpec":
        if self.mode == MOE:
            if self.experts is None:
                raise ValueError("mode 'moe' needs an 'experts' section (layers, grid, dim, k, ...)")
            if self.model.name != "moe":
                raise ValueError(
                    f"mode 'moe' trains the trunk of a mixture-of-experts model: model.name is 'moe', not "
                    f"{self.model.name!r}"
                )
            if self.framework != "pytorch":
                raise ValueError("mode 'moe' trainers run PyTorch: use framework 'pytorch'")
        else:
            if self.experts is not None:
                raise ValueError(f"an 'experts' section is only allowed with mode 'moe', not {self.mode!r}")
            if self.model.name == "moe":
                raise ValueError("model 'moe' is the trunk of a mixture-of-experts model: it needs mode 'moe'")
        return self

    @model_validator(mode="after")
    def _framework_runs_the_model(self) -> "JobSpec":
        if self.model.name == KERAS_MODEL and self.framework != "tensorflow":
            raise ValueError("a Keras JSON model (model.name 'keras') needs framework: tensorflow")
        if self.model.name != KERAS_MODEL and self.model.name not in ZOO_PORTS[self.framework]:
            raise ValueError(
                f"model {self.model.name!r} has no {self.framework} port; "
                f"{self.framework} runs {sorted(ZOO_PORTS[self.framework])}"
            )
        return self

    def configure_model(self, input_shape: list[int], num_classes: int) -> dict[str, Any]:
        """The job's model as clients, parameter servers and the zoo build it: the spec's model
        section with the framework and the dataset's example shape and class count."""
        config: dict[str, Any] = {
            "name": self.model.name,
            "framework": self.framework,
            "input_shape": input_shape,
            "num_classes": num_classes,
            "options": self.model.options,
        }
        if self.experts is not None:  # the trunk's shape (crowdtrain.core.zoo_experts.MixtureTrunk)
            config["options"] = {**self.model.options, "layout": self.experts.model_dump(mode="json")}
        if self.model.keras is not None:
            config["keras"] = self.model.keras
        return config


def load_job_spec(path: Path, notes: list[str] | None = None) -> JobSpec:
    """Read a YAML or JSON job spec file; raises pydantic.ValidationError or ValueError (one line
    for a file that cannot be read or parsed: see crowdtrain.core.specfile for the bounds).

    `model.keras_file: PATH` (relative to the spec file) is read into `model.keras`. A relative
    `dataset.source: FORMAT:PATH` is resolved against the spec file's folder (`crowdtrain job
    submit` then uploads it, or sends the path for the scheduler to read); that is said in `notes`.
    """
    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise SpecFileError(f"{path}: a job spec is a mapping, got {type(data).__name__}")
    model = data.get("model")
    if isinstance(model, dict) and "keras_file" in model:
        keras_path = path.parent / str(model.pop("keras_file"))
        try:
            model["keras"] = json.loads(read_bounded(keras_path, MAX_KERAS_JSON_BYTES))
        except json.JSONDecodeError as exc:
            raise SpecFileError(f"{keras_path}: not JSON: {exc}") from None
    note = resolve_relative_source(data.get("dataset"), path.parent)
    if note is not None and notes is not None:
        notes.append(note)
    return JobSpec.model_validate(data)
