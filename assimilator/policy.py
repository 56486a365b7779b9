"""Policy that applies to every merge rule: the staleness bound, the update-norm bound and clipping.

It wraps the rule (`apply_with_policy`) instead of living inside one, as Flower's clipping and
differential-privacy strategies wrap an inner strategy: a rule never refuses, the policy does.

A result is judged by its update Δ = W_c − W_base, measured against the snapshot the host started
from, not against the current W_s: an honest result that is a few merges stale would otherwise look
as large as the distance W_s has moved since. The default bound is relative, so it needs no tuning
per model: ||Δ|| may be at most `factor` times the median norm of the job's recently accepted
updates; until `warmup` updates have been accepted, at most `factor` times ||W_base|| (or `factor`
when ||W_base|| < 1, so that a model initialised near zero can still learn). The median moves
little when a few hosts upload huge updates, which is the point; an operator's absolute
`max_update_norm` applies as well.

A result whose update carries no training is refused too, with or without the job's validation
section: W_base uploaded unchanged, or W_base + c everywhere (every tensor of Δ zero or constant). An
honest update moves different weights differently; a lazy host's moves none, or all alike.

A W_s that diverges stops the job (`Policy.divergence`, checked at each evaluation): its validation
loss staying above a multiple of its lowest says the rule's steps overshoot, and merging more makes
it worse; the job fails saying so, instead of training on to its budget.

Pure functions over named arrays and plain numbers; no I/O.
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crowdtrain.assimilator.rules.update import Rule, Update, params_norm
from crowdtrain.core.assimilationspec import AnyAssimilation, assimilation_of
from crowdtrain.core.tensors import Params


@dataclass(frozen=True)
class UpdateBound:
    """The bound on ||W_c − W_base|| (see crowdtrain.core.assimilationspec.PolicySpec for the meaning and
    defaults)."""

    factor: float | None
    warmup: int
    max_update_norm: float | None = None

    @classmethod
    def from_spec(cls, assimilation: dict[str, Any] | AnyAssimilation) -> "UpdateBound":
        a = assimilation_of(assimilation)
        return cls(factor=a.update_norm_factor, warmup=a.update_norm_warmup, max_update_norm=a.max_update_norm)


def norm_limit(bound: UpdateBound, recent_norms: Sequence[float], base_norm: float) -> tuple[float, str]:
    """The largest acceptable ||Δ||, and what it was derived from (for the refusal message)."""
    limits: list[tuple[float, str]] = []
    if bound.factor is not None:
        if len(recent_norms) >= bound.warmup:
            median = statistics.median(recent_norms)
            limits.append(
                (
                    bound.factor * median,
                    f"{bound.factor:g} x the median {median:.3g} of {len(recent_norms)} accepted update norms",
                )
            )
        else:
            reference = max(base_norm, 1.0)
            limits.append(
                (
                    bound.factor * reference,
                    f"{bound.factor:g} x max(||W_base||, 1) = {bound.factor:g} x {reference:.3g} "
                    f"(warm-up: {len(recent_norms)} of {bound.warmup} accepted updates)",
                )
            )
    if bound.max_update_norm is not None:
        limits.append((bound.max_update_norm, f"max_update_norm {bound.max_update_norm:g}"))
    return min(limits, default=(float("inf"), "no bound"))


def norm_refusal(norm: float, bound: UpdateBound, recent_norms: Sequence[float], base_norm: float) -> str | None:
    """Why an update of norm `norm` must not be merged, or None when it may be."""
    limit, why = norm_limit(bound, recent_norms, base_norm)
    if not norm <= limit:  # also refuses a NaN norm
        return f"update norm ||W_c - W_base|| = {norm:.3g} exceeds {limit:.3g} ({why})"
    return None


def staleness_refusal(base_version: int, version: int, max_staleness: int | None) -> str | None:
    """Why a result based on `base_version` must not be merged into W_s `version`, or None."""
    if max_staleness is not None and version - base_version > max_staleness:
        return f"stale result: based on v{base_version}, W_s is v{version} (max_staleness {max_staleness})"
    return None


def _moves_weights_differently(delta: np.ndarray, client: np.ndarray, min_spread: float) -> bool:
    """Whether Δ of one tensor spreads over more than `min_spread` (relative to its largest weight, and
    never less than 4 ulps of its dtype, which W_c − W_base of a constant shift rounds to)."""
    if delta.size == 0:
        return False
    low, high = float(delta.min()), float(delta.max())
    if delta.size == 1 or high == low:
        return delta.size == 1 and high != 0.0
    scale = float(np.abs(client).max()) + max(abs(low), abs(high))
    return high - low > max(min_spread, 4 * float(np.finfo(delta.dtype).eps)) * scale


def no_training_refusal(update: Update, min_spread: float | None) -> str | None:
    """Why `update` must not be merged because it carries no training (every float tensor of Δ zero or
    constant), or None. Stops at the first tensor that moved, so an honest update costs one tensor."""
    if min_spread is None or not update.delta:
        return None
    if any(_moves_weights_differently(d, update.client[k], min_spread) for k, d in update.delta.items()):
        return None
    return (
        "update carries no training: every tensor of W_c - W_base is zero or constant "
        f"(spread at most {min_spread:g} of its largest weight)"
    )


def clipped(update: Update, clip_norm: float | None) -> Update:
    """`update` with Δ scaled down to norm `clip_norm` when it is longer (and W_c moved with it, for
    the rules that read W_c: W_c' = W_base + c·Δ = W_c − (1 − c)·Δ); otherwise `update` itself.

    Unlike the norm bound, which refuses a result, clipping keeps every honest result and only
    limits how far one can move W_s.
    """
    if clip_norm is None:
        return update
    norm = params_norm(update.delta)
    if norm <= clip_norm:
        return update
    scale = clip_norm / norm
    delta = {k: d * np.asarray(scale, d.dtype) for k, d in update.delta.items()}
    client = {k: (w - (update.delta[k] - delta[k]) if k in delta else w) for k, w in update.client.items()}
    return Update(client, delta, update.staleness, update.epoch)


@dataclass(frozen=True)
class Policy:
    """Everything every merge obeys, from the job spec's `assimilation` section."""

    bound: UpdateBound
    max_staleness: int | None
    clip_norm: float | None
    min_update_spread: float | None
    divergence_factor: float | None
    divergence_patience: int

    @classmethod
    def from_spec(cls, assimilation: dict[str, Any] | AnyAssimilation) -> "Policy":
        """The policy of a job's `assimilation` section (as stored: a dict, or read already; missing fields
        take the spec's defaults, crowdtrain.core.assimilationspec.PolicySpec)."""
        a = assimilation_of(assimilation)
        return cls(
            UpdateBound.from_spec(a),
            a.max_staleness,
            a.clip_norm,
            a.min_update_spread,
            a.divergence_factor,
            a.divergence_patience,
        )

    def divergence(self, best_loss: float, latest_losses: Sequence[float]) -> str | None:
        """Why W_s has diverged, from its validation losses: the job's lowest so far and its latest
        (newest last); None while it has not. Diverged: each of the latest `divergence_patience`
        losses above `divergence_factor` times the lowest (or not finite). A rule that overshoots
        (a server step too large for the number of concurrent hosts) shows it so; honest noise
        between evaluations does not reach a multiple of the best loss."""
        if self.divergence_factor is None or len(latest_losses) < self.divergence_patience:
            return None
        bound = self.divergence_factor * best_loss
        latest = list(latest_losses)[-self.divergence_patience :]
        if not math.isfinite(best_loss) or any(math.isfinite(loss) and loss <= bound for loss in latest):
            return None
        shown = ", ".join(f"{loss:.4g}" for loss in latest)
        return (
            f"W_s's last {self.divergence_patience} validation losses ({shown}) are all above "
            f"{self.divergence_factor:g} x its lowest, {best_loss:.4g}"
        )

    def refusal(
        self, update: Update, version: int, norm: float, recent_norms: Sequence[float], base_norm: float
    ) -> str | None:
        """Why `update` (norm ||W_c − W_base|| = `norm`) must not be merged into W_s `version`, or None."""
        return (
            staleness_refusal(version - update.staleness, version, self.max_staleness)
            or no_training_refusal(update, self.min_update_spread)
            or norm_refusal(norm, self.bound, recent_norms, base_norm)
        )


def merged_alone(policy: Policy, rule: Rule, server: Params, state: Params, update: Update) -> Params:
    """W_s as `rule` would leave it after merging `update` alone (clipped as the policy clips), computed
    on copies: `server` and `state` are left as they are. The validator measures a replica here, at
    the point its merge would make, not at W_s + Δ: VC-ASGD averages W_c into W_s, and W_s + Δ of a
    result a few merges stale is a point no merge produces (for this job's honest results it measured
    20-110% above W_s's held-out loss, where the merge itself does not move it much). The policy's
    bounds are not checked here; they are when the chosen replica is merged."""
    moved = {k: np.array(v, copy=True) for k, v in server.items()}
    rule.apply(moved, {k: np.array(v, copy=True) for k, v in state.items()}, clipped(update, policy.clip_norm))
    return moved


def apply_with_policy(
    policy: Policy,
    rule: Rule,
    server: Params,
    state: Params,
    update: Update,
    version: int,
    norm: float,
    recent_norms: Sequence[float],
    base_norm: float,
) -> str | None:
    """Merge `update` into W_s `version` (`server`, and the rule's `state`, in place) unless the policy
    refuses it: the refusal, or None once merged. A refused update changes nothing."""
    refusal = policy.refusal(update, version, norm, recent_norms, base_norm)
    if refusal is None:
        rule.apply(server, state, clipped(update, policy.clip_norm))
    return refusal
