"""The job spec: what an operator submits (YAML or JSON), validated with clear errors. Its dataset,
model, assimilation, validation and dedloc sections have modules of their own
(crowdtrain.core.datasetspec, crowdtrain.core.modelspec, crowdtrain.core.assimilationspec,
crowdtrain.core.validationspec, crowdtrain.core.dedlocspec)."""

import json
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import Field, model_validator

from crowdtrain.core.assimilationspec import AssimilationSpec, FedBuffSpec, default_assimilation
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
    assimilation: AssimilationSpec = Field(
        default_factory=default_assimilation,
        description="The merge rule and its options, one section per rule chosen by its `rule`. A section without "
        "a rule gets the default configuration: rule delta, server_lr 1, staleness_weight polynomial "
        "(staleness_a 0.5), step_control loss (crowdtrain.core.assimilationspec.DEFAULT_ASSIMILATION), its "
        "other fields as given",
    )
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
        if self.scheduling.rounds and not isinstance(self.assimilation, FedBuffSpec):
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
