"""Merge rules: pure functions and small classes over dicts of named numpy arrays. No I/O.

A rule is picked by `assimilation.rule`, whose model of options (crowdtrain.core.assimilationspec) its
builder reads (`BUILDERS`, `make_rule`). It sees one result at a time as an `Update`
and changes W_s, and its own state (named arrays kept beside W_s in Redis and written in the same
exactly-once transaction: crowdtrain.server.paramstore.store), in place. Policy that applies to every rule
(staleness bound, update-norm bound, clipping, refusals) lives in crowdtrain.assimilator.policy and wraps the
rule; a rule never refuses.

- `vc-asgd` (vc_asgd.py): the paper's W_s <- α·W_s + (1 − α)·W_c.
- `delta`, `fedbuff` (delta.py): updates Δ weighted by staleness (staleness.py), buffered and
  combined (combiners.py), applied by an outer optimizer (outer.py); `delta` with the weight
  `gain` (gain.py) scales each update by AdaScale's gain estimated from the updates' noise;
  `step_control: loss` (control.py) scales the step by a factor that follows the validation loss.
"""

from collections.abc import Callable
from typing import Any

from crowdtrain.assimilator.rules.control import LossControlled
from crowdtrain.assimilator.rules.delta import Delta, FedBuff
from crowdtrain.assimilator.rules.gain import GainDelta
from crowdtrain.assimilator.rules.outer import OuterOptimizer, make_outer
from crowdtrain.assimilator.rules.staleness import StalenessWeight
from crowdtrain.assimilator.rules.update import Rule, Update, make_update
from crowdtrain.assimilator.rules.vc_asgd import VcAsgd, alpha_for_epoch, merge_vc_asgd, update_norm
from crowdtrain.core.assimilationspec import (
    AnyAssimilation,
    DeltaSpec,
    FedBuffSpec,
    PolicySpec,
    SteppingSpec,
    VcAsgdSpec,
    assimilation_of,
)


def _vc_asgd(spec: VcAsgdSpec) -> Rule:
    return VcAsgd(spec.schedule, spec.alpha)


def _delta(spec: DeltaSpec) -> Rule:
    outer = _outer(spec)
    if spec.staleness_weight == "gain":
        return _controlled(spec, GainDelta(outer))
    return _controlled(spec, Delta(_weight(spec), outer))


def _fedbuff(spec: FedBuffSpec) -> Rule:
    rule = FedBuff(_weight(spec), _outer(spec), spec.buffer_size, spec.combiner, spec.trim_fraction)
    return _controlled(spec, rule)


def _outer(spec: SteppingSpec) -> OuterOptimizer:
    return make_outer(
        spec.outer_optimizer, spec.server_lr, spec.outer_momentum, spec.nesterov_delay, spec.adam_betas, spec.adam_eps
    )


def _weight(spec: SteppingSpec) -> StalenessWeight:
    return StalenessWeight(spec.staleness_weight, spec.staleness_a, spec.staleness_b)


def _controlled(spec: SteppingSpec, rule: Rule) -> Rule:
    return LossControlled(rule, spec.step_floor) if spec.step_control == "loss" else rule


# What builds each rule from the model of its options (one per rule of
# crowdtrain.core.assimilationspec.RULE_SPECS).
BUILDERS: dict[type[PolicySpec], Callable[[Any], Rule]] = {
    VcAsgdSpec: _vc_asgd,
    DeltaSpec: _delta,
    FedBuffSpec: _fedbuff,
}


def make_rule(assimilation: dict[str, Any] | AnyAssimilation) -> Rule:
    """The merge rule a job's `assimilation` section (as stored: a dict, or read already) selects.

    The dict is read through its rule's model (crowdtrain.core.assimilationspec.assimilation_of), so
    missing fields take their defaults and a bad value, or another rule's option, raises a pydantic
    ValidationError (a ValueError) that names the field.
    """
    spec = assimilation_of(assimilation)
    return BUILDERS[type(spec)](spec)


def reads_validation(assimilation: dict[str, Any] | AnyAssimilation) -> bool:
    """Whether the rule of `assimilation` reads the job's latest evaluation (`Update.validation`)."""
    spec = assimilation_of(assimilation)
    return isinstance(spec, SteppingSpec) and spec.step_control != "none"


__all__ = [
    "Delta",
    "FedBuff",
    "GainDelta",
    "LossControlled",
    "Rule",
    "StalenessWeight",
    "Update",
    "VcAsgd",
    "alpha_for_epoch",
    "BUILDERS",
    "make_rule",
    "make_outer",
    "make_update",
    "merge_vc_asgd",
    "reads_validation",
    "update_norm",
]
