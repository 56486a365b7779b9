"""The job spec's `assimilation` section: which merge rule a job's parameter servers run
(crowdtrain.assimilator.rules), with its options, the policy every rule is wrapped in
(crowdtrain.assimilator.policy) and what clients upload; the default configuration, and the one line
that says which options a job's rule reads (`effective_rule`)."""

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, model_validator

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


class AssimilationSpec(SpecSection):
    rule: Literal["vc-asgd", "delta", "fedbuff"] = Field(
        DEFAULT_ASSIMILATION["rule"],
        description="vc-asgd: W_s <- a*W_s + (1-a)*W_c; delta: W_s <- W_s + server_lr * s(tau) * Δ; "
        "fedbuff: buffer buffer_size updates, combine, apply once. A section without a rule gets the "
        "default configuration: delta, server_lr 1, staleness_weight polynomial (staleness_a 0.5), "
        "step_control loss (crowdtrain.core.assimilationspec.DEFAULT_ASSIMILATION), its other fields as given",
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


STEPPING = "delta/fedbuff"  # an option of the rules that take a step (every rule but vc-asgd)

# The options a merge rule reads, in the order they are shown: (name, whose option it is (a rule,
# STEPPING, or None: any rule's), and when that rule reads it (None: always)).
_OPTIONS: tuple[tuple[str, str | None, Callable[[AssimilationSpec], bool] | None], ...] = (
    ("schedule", "vc-asgd", None),
    ("alpha", "vc-asgd", lambda a: a.schedule == "constant"),
    ("server_lr", STEPPING, None),
    ("staleness_weight", STEPPING, None),
    ("staleness_a", STEPPING, lambda a: a.staleness_weight in ("polynomial", "hinge")),
    ("staleness_b", STEPPING, lambda a: a.staleness_weight == "hinge"),
    ("buffer_size", "fedbuff", None),
    ("combiner", "fedbuff", None),
    ("trim_fraction", "fedbuff", lambda a: a.combiner == "trimmed-mean"),
    ("outer_optimizer", STEPPING, lambda a: a.outer_optimizer != "none"),
    ("outer_momentum", STEPPING, lambda a: a.outer_optimizer in ("nesterov", "delayed-nesterov")),
    ("nesterov_delay", STEPPING, lambda a: a.outer_optimizer == "delayed-nesterov"),
    ("adam_betas", STEPPING, lambda a: a.outer_optimizer == "adam"),
    ("step_control", STEPPING, None),
    ("step_floor", STEPPING, lambda a: a.step_control != "none"),
    ("clip_norm", None, lambda a: a.clip_norm is not None),
    ("max_staleness", None, lambda a: a.max_staleness is not None),
)

# Fields that only one rule reads: given without a rule, they would silently do nothing.
_OWN_FIELDS: dict[str, tuple[str, ...]] = {
    rule: tuple(name for name, owner, _ in _OPTIONS if owner == rule) for rule in MERGE_RULES
}


def _reads(a: AssimilationSpec, owner: str | None, when: Callable[[AssimilationSpec], bool] | None) -> bool:
    mine = owner is None or owner == a.rule or (owner == STEPPING and a.rule != "vc-asgd")
    return mine and (when is None or when(a))


def effective_rule(a: AssimilationSpec) -> str:
    """The merge rule a job runs with and the options it reads, defaults included, in one line (the
    scheduler logs it when the job is created): what a spec left out is shown, not guessed."""
    shown = ", ".join(f"{name} {getattr(a, name)}" for name, owner, when in _OPTIONS if _reads(a, owner, when))
    return f"{a.rule} ({shown})"


def buffer_size_of(spec: dict[str, Any]) -> int:
    """fedbuff's buffer (the results combined per step, a round's K) of a stored job spec; the model's
    default where a spec stored before the field existed leaves it out."""
    return int(spec.get("assimilation", {}).get("buffer_size", AssimilationSpec.model_fields["buffer_size"].default))
