"""Merge rules: pure functions and small classes over dicts of named numpy arrays. No I/O.

A rule is picked by `assimilation.rule` (`make_rule`). It sees one result at a time as an `Update`
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

from typing import Any

from crowdtrain.assimilator.rules.control import LossControlled
from crowdtrain.assimilator.rules.delta import Delta, FedBuff
from crowdtrain.assimilator.rules.gain import GainDelta
from crowdtrain.assimilator.rules.outer import make_outer
from crowdtrain.assimilator.rules.staleness import StalenessWeight
from crowdtrain.assimilator.rules.update import Rule, Update, make_update
from crowdtrain.assimilator.rules.vc_asgd import VcAsgd, alpha_for_epoch, merge_vc_asgd, update_norm
from crowdtrain.core.assimilationspec import AssimilationSpec


def make_rule(assimilation: dict[str, Any]) -> Rule:
    """The merge rule a job's `assimilation` section (as stored: a dict) selects.

    The dict is read through AssimilationSpec, so missing fields take the spec's defaults and a bad
    value raises a pydantic ValidationError (a ValueError) that names the field.
    """
    spec = AssimilationSpec.model_validate(assimilation)
    if spec.rule == "vc-asgd":
        return VcAsgd(spec.schedule, spec.alpha)
    outer = make_outer(
        spec.outer_optimizer, spec.server_lr, spec.outer_momentum, spec.nesterov_delay, spec.adam_betas, spec.adam_eps
    )
    rule: Rule
    if spec.staleness_weight == "gain":  # the spec allows it with rule delta only
        return _controlled(spec, GainDelta(outer))
    weight = StalenessWeight(spec.staleness_weight, spec.staleness_a, spec.staleness_b)
    if spec.rule == "delta":
        rule = Delta(weight, outer)
    elif spec.rule == "fedbuff":
        rule = FedBuff(weight, outer, spec.buffer_size, spec.combiner, spec.trim_fraction)
    else:
        raise ValueError(f"unknown merge rule {spec.rule!r}")
    return _controlled(spec, rule)


def _controlled(spec: AssimilationSpec, rule: Rule) -> Rule:
    return LossControlled(rule, spec.step_floor) if spec.step_control == "loss" else rule


def reads_validation(assimilation: dict[str, Any]) -> bool:
    """Whether the rule of `assimilation` reads the job's latest evaluation (`Update.validation`)."""
    return AssimilationSpec.model_validate(assimilation).step_control != "none"


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
    "make_rule",
    "make_outer",
    "make_update",
    "merge_vc_asgd",
    "reads_validation",
    "update_norm",
]
