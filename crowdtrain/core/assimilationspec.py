"""The job spec's `assimilation` section: which merge rule a job's parameter servers run
(crowdtrain.assimilator.rules) with the options that rule owns, the policy every rule is wrapped in
(crowdtrain.assimilator.policy) and what clients upload; the default configuration, and the one line
that says which options a job's rule reads (`effective_rule`).

The section is one model per rule (VcAsgdSpec, DeltaSpec, FedBuffSpec), chosen by its `rule`: a
discriminated union (`AssimilationSpec`), so a rule's section holds its own options and the policy's,
and an option of another rule is refused with a message that names its rule. `assimilation_of` reads
a stored section (a dict) into its model."""

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

from crowdtrain.core.specfile import SpecSection


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


class PolicySpec(SpecSection):
    """What every rule's section holds: the policy the rule is wrapped in and what clients upload."""

    rule: str  # each rule's model narrows it to its own name, the union's discriminator
    clip_norm: float | None = Field(None, gt=0, description="Scale any update whose norm is above this down to it")
    upload: UploadSpec = Field(default_factory=UploadSpec)
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
    def _options_of_other_rules(cls, data: Any) -> Any:
        """An option that another rule owns is refused saying whose it is (pydantic would say only
        "extra inputs are not permitted")."""
        if isinstance(data, dict):
            rule = data.get("rule")
            for name in data:
                owners = _owners(name)
                if name not in cls.model_fields and owners:
                    raise ValueError(
                        f"assimilation.{name} is an option of rule {' and '.join(owners)}, not of rule {rule}"
                    )
        return data


class VcAsgdSpec(PolicySpec):
    """vc-asgd: W_s <- alpha*W_s + (1-alpha)*W_c at each merge (crowdtrain.assimilator.rules.vc_asgd)."""

    rule: Literal["vc-asgd"]
    schedule: Literal["constant", "epoch"] = Field("constant", description="constant alpha, or alpha_e = e/(e+1)")
    alpha: float = Field(0.6, ge=0, lt=1, description="W_s keeps this share of itself at each merge")


class SteppingSpec(PolicySpec):
    """The options of the rules that take a step along the update Δ = W_c − W_base (delta, fedbuff)."""

    server_lr: float = Field(
        1.0,
        gt=0,
        le=100,
        description="The server step η on the (combined) update, or the outer optimizer's learning rate",
    )
    staleness_weight: Literal["constant", "polynomial", "hinge", "gain"] = Field(
        "constant",
        description="s(tau) = 1; (1+tau)^-staleness_a; or 1 for tau <= staleness_b, else "
        "1/(staleness_a*(tau-staleness_b)+1) (FedAsync); rule delta only: gain, r(1+tau)/(1+tau) with "
        "AdaScale's gain r estimated from the updates' noise (crowdtrain.assimilator.rules.gain)",
    )
    staleness_a: float = Field(0.5, ge=0, le=100)
    staleness_b: int = Field(4, ge=0, le=1_000_000)
    step_control: Literal["none", "loss"] = Field(
        "none",
        description="none, or loss: the step scaled by c, which starts at step_floor, grows x1.1 at each "
        "evaluation whose validation loss is below the previous one (to 1) and halves at one more than 5% "
        "above it (to step_floor): a step that follows what the task tolerates "
        "(crowdtrain.assimilator.rules.control)",
    )
    step_floor: float = Field(0.0625, gt=0, le=1, description="step_control loss: the smallest (and first) c")
    outer_optimizer: Literal["none", "nesterov", "delayed-nesterov", "adam"] = Field(
        "none",
        description="An optimizer over the combined update taken as a pseudo-gradient: SGD with Nesterov "
        "momentum (DiLoCo), delayed Nesterov (Async Local-SGD), or Adam with staleness-gated input",
    )
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov_delay: int = Field(4, ge=1, le=1024, description="delayed-nesterov: updates between momentum steps")
    adam_betas: tuple[float, float] = Field((0.9, 0.99))
    adam_eps: float = Field(1e-8, gt=0)

    @model_validator(mode="after")
    def _betas(self) -> "SteppingSpec":
        if any(not 0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"assimilation.adam_betas must lie in [0, 1), got {list(self.adam_betas)}")
        return self


class DeltaSpec(SteppingSpec):
    """delta: W_s <- W_s + server_lr * s(tau) * Δ at each merge (crowdtrain.assimilator.rules.delta)."""

    rule: Literal["delta"]


class FedBuffSpec(SteppingSpec):
    """fedbuff: buffer_size updates buffered, combined and applied in one step (crowdtrain.assimilator.rules.delta)."""

    rule: Literal["fedbuff"]
    staleness_weight: Literal["constant", "polynomial", "hinge"] = Field(
        "constant",
        description="s(tau) = 1; (1+tau)^-staleness_a; or 1 for tau <= staleness_b, else "
        "1/(staleness_a*(tau-staleness_b)+1) (FedAsync)",
    )
    buffer_size: int = Field(4, ge=1, le=1024, description="Updates combined per step of W_s")
    combiner: Literal["mean", "median", "trimmed-mean"] = Field(
        "mean", description="How buffered updates combine (median and trimmed-mean resist outliers)"
    )
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="trimmed-mean: the fraction cut at each end")


# The rules, by name, each with the model of its options.
RULE_SPECS: dict[str, type[PolicySpec]] = {"vc-asgd": VcAsgdSpec, "delta": DeltaSpec, "fedbuff": FedBuffSpec}


def _owners(option: str) -> list[str]:
    """The rules whose sections hold `option`."""
    return [rule for rule, model in RULE_SPECS.items() if option in model.model_fields]


def _default_configuration(data: Any) -> Any:
    """A section that names no rule starts from DEFAULT_ASSIMILATION; what it sets wins."""
    if isinstance(data, dict) and isinstance(data.get("rule"), str) and data["rule"] not in RULE_SPECS:
        raise ValueError(f"assimilation.rule {data['rule']!r} is not a merge rule: one of {', '.join(RULE_SPECS)}")
    if not isinstance(data, dict) or "rule" in data:
        return data
    default = DEFAULT_ASSIMILATION["rule"]
    for name in data:
        owners = _owners(name)
        if owners and default not in owners:
            raise ValueError(
                f"assimilation.{name} is a {' and '.join(owners)} setting, and a section without a rule gets the "
                f"default ({default}): add `rule: {owners[0]}`"
            )
    return DEFAULT_ASSIMILATION | data


AnyAssimilation = VcAsgdSpec | DeltaSpec | FedBuffSpec
AssimilationSpec = Annotated[AnyAssimilation, Field(discriminator="rule"), BeforeValidator(_default_configuration)]
_ADAPTER: TypeAdapter[AnyAssimilation] = TypeAdapter(AssimilationSpec, config=ConfigDict(title="assimilation"))


def assimilation_of(section: "dict[str, Any] | AnyAssimilation | None" = None) -> AnyAssimilation:
    """The model of an `assimilation` section (a stored job's, or one written by hand): missing fields
    take their defaults, no rule the default configuration; a bad value raises pydantic's
    ValidationError (a ValueError) naming the field. A section read already is returned as it is, so
    that a merge that reads the section once can hand the model to each part that needs it."""
    if isinstance(section, VcAsgdSpec | DeltaSpec | FedBuffSpec):
        return section
    return _ADAPTER.validate_python({} if section is None else section)


def default_assimilation() -> AnyAssimilation:
    """The section a spec without one gets."""
    return assimilation_of()


# The options effective_rule shows, in order, each with when its rule reads it (None: always) among
# the options its rule's model holds (the policy's are shown only when set).
_SHOWN: tuple[tuple[str, Callable[[Any], bool] | None], ...] = (
    ("schedule", None),
    ("alpha", lambda a: a.schedule == "constant"),
    ("server_lr", None),
    ("staleness_weight", None),
    ("staleness_a", lambda a: a.staleness_weight in ("polynomial", "hinge")),
    ("staleness_b", lambda a: a.staleness_weight == "hinge"),
    ("buffer_size", None),
    ("combiner", None),
    ("trim_fraction", lambda a: a.combiner == "trimmed-mean"),
    ("outer_optimizer", lambda a: a.outer_optimizer != "none"),
    ("outer_momentum", lambda a: a.outer_optimizer in ("nesterov", "delayed-nesterov")),
    ("nesterov_delay", lambda a: a.outer_optimizer == "delayed-nesterov"),
    ("adam_betas", lambda a: a.outer_optimizer == "adam"),
    ("step_control", None),
    ("step_floor", lambda a: a.step_control != "none"),
    ("clip_norm", lambda a: a.clip_norm is not None),
    ("max_staleness", lambda a: a.max_staleness is not None),
)


def effective_rule(a: PolicySpec) -> str:
    """The merge rule a job runs with and the options it reads, defaults included, in one line (the
    scheduler logs it when the job is created): what a spec left out is shown, not guessed."""
    fields = type(a).model_fields
    shown = ", ".join(
        f"{name} {getattr(a, name)}" for name, when in _SHOWN if name in fields and (when is None or when(a))
    )
    return f"{a.rule} ({shown})"


def buffer_size_of(spec: dict[str, Any]) -> int:
    """fedbuff's buffer (the results combined per step, a round's K) of a stored job spec; 1 for the
    rules that merge each result on its own."""
    a = assimilation_of(spec.get("assimilation"))
    return a.buffer_size if isinstance(a, FedBuffSpec) else 1
