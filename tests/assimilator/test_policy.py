"""The update-norm and staleness bounds and the clipping that wrap every merge rule."""

import math

import numpy as np
import pytest

from crowdtrain.assimilator.policy import (
    Policy,
    UpdateBound,
    apply_with_policy,
    clipped,
    merged_alone,
    norm_limit,
    norm_refusal,
    params_norm,
    staleness_refusal,
)
from crowdtrain.assimilator.rules import Update, make_rule
from crowdtrain.core.assimilationspec import assimilation_of

DEFAULT = UpdateBound.from_spec(assimilation_of().model_dump())


def test_the_default_bound_is_on_and_relative() -> None:
    assert UpdateBound(factor=10.0, warmup=5, max_update_norm=None) == DEFAULT


def test_params_norm_skips_integer_counters() -> None:
    assert params_norm({"w": np.array([3.0, 4.0], np.float32), "n": np.array(1000, np.int64)}) == pytest.approx(5.0)


@pytest.mark.parametrize(("base_norm", "limit"), [(6.0, 60.0), (0.0, 10.0), (0.5, 10.0)])
def test_during_warm_up_the_bound_follows_the_base_norm(base_norm: float, limit: float) -> None:
    assert norm_limit(DEFAULT, [1.0] * 4, base_norm)[0] == pytest.approx(limit)


def test_after_warm_up_the_bound_follows_the_median_of_accepted_norms() -> None:
    recent = [5.0, 5.2, 4.8, 900.0, 5.1]  # one huge accepted update moves the median little
    limit, why = norm_limit(DEFAULT, recent, base_norm=1000.0)
    assert limit == pytest.approx(51.0)
    assert "median" in why


def test_the_operators_absolute_bound_still_applies() -> None:
    bound = UpdateBound(factor=10.0, warmup=5, max_update_norm=3.0)
    assert norm_limit(bound, [5.0] * 10, 6.0)[0] == 3.0
    assert "max_update_norm 3" in norm_refusal(4.0, bound, [5.0] * 10, 6.0)


def test_without_any_bound_everything_finite_passes() -> None:
    bound = UpdateBound(factor=None, warmup=5, max_update_norm=None)
    assert norm_refusal(1e300, bound, [], 1.0) is None


@pytest.mark.parametrize(
    ("norm", "refused"), [(9.0, False), (50.0, False), (53.0, True), (1e32, True), (math.inf, True), (math.nan, True)]
)
def test_updates_beyond_the_bound_are_refused(norm: float, refused: bool) -> None:
    reason = norm_refusal(norm, DEFAULT, [5.2] * 10, base_norm=15.0)
    assert (reason is not None) == refused
    if refused:
        assert "exceeds 52" in reason


def test_staleness() -> None:
    assert staleness_refusal(3, 10, None) is None
    assert staleness_refusal(3, 10, 7) is None
    assert "stale result: based on v3, W_s is v11" in staleness_refusal(3, 11, 7)


def _update(delta_value: list[float]) -> Update:
    base = np.array([1.0, 1.0], np.float32)
    delta = np.array(delta_value, np.float32)
    return Update(client={"w": base + delta, "n": np.array(3)}, delta={"w": delta}, staleness=2, epoch=1)


def test_clipping_scales_a_long_update_down_to_the_clip_norm_and_moves_w_c_with_it() -> None:
    update = clipped(_update([3.0, 4.0]), clip_norm=1.0)
    np.testing.assert_allclose(update.delta["w"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(update.client["w"], [1.6, 1.8], rtol=1e-6)
    assert update.client["n"] == 3 and update.staleness == 2


def test_clipping_leaves_a_short_update_alone() -> None:
    update = _update([0.3, 0.4])
    assert clipped(update, clip_norm=1.0) is update
    assert clipped(update, clip_norm=None) is update


def test_the_policy_wraps_any_rule_refusing_before_the_rule_sees_the_update() -> None:
    policy = Policy.from_spec(assimilation_of(dict(rule="delta", max_staleness=1, clip_norm=1.0)).model_dump())
    rule = make_rule({"rule": "delta"})
    server = {"w": np.zeros(2, np.float32), "n": np.array(0)}
    refusal = apply_with_policy(
        policy, rule, server, {}, _update([3.0, 4.0]), version=10, norm=5.0, recent_norms=[], base_norm=1.4
    )
    assert refusal == "stale result: based on v8, W_s is v10 (max_staleness 1)"
    np.testing.assert_array_equal(server["w"], [0, 0])
    fresh = Update(**{**_update([3.0, 4.0]).__dict__, "staleness": 1})
    assert apply_with_policy(policy, rule, server, {}, fresh, 10, 5.0, [], 1.4) is None
    np.testing.assert_allclose(server["w"], [0.6, 0.8], rtol=1e-6)  # clipped to norm 1 by the policy
    assert "exceeds" in apply_with_policy(policy, rule, server, {}, fresh, 10, 1e6, [], 1.4)


def test_merged_alone_is_the_point_the_rules_merge_would_make_and_leaves_w_s_as_it_was() -> None:
    """A VC-ASGD result is measured at alpha·W_s + (1 − alpha)·W_c, not at W_s + Δ: for a stale result
    the two differ by everything W_s has moved since its base."""
    spec = assimilation_of(dict(rule="vc-asgd", alpha=0.6)).model_dump()
    server = {"w": np.array([1.0, 1.0], np.float32)}
    base = {"w": np.array([0.0, 0.0], np.float32)}  # W_s moved by (1, 1) since this result's base
    client = {"w": np.array([0.5, 0.0], np.float32)}
    update = Update(client, {"w": client["w"] - base["w"]}, staleness=3, epoch=1)
    moved = merged_alone(Policy.from_spec(spec), make_rule(spec), server, {}, update)
    np.testing.assert_allclose(moved["w"], [0.8, 0.6], rtol=1e-6)  # 0.6·(1, 1) + 0.4·(0.5, 0); W_s + Δ: (1.5, 1)
    np.testing.assert_array_equal(server["w"], [1.0, 1.0])


def test_merged_alone_is_what_the_policy_wrapped_rule_merges_and_keeps_a_stateful_rules_state() -> None:
    spec = assimilation_of(dict(rule="delta", outer_optimizer="nesterov", clip_norm=1.0)).model_dump()
    policy, rule = Policy.from_spec(spec), make_rule(spec)
    server = {"w": np.zeros(2, np.float32)}
    state = rule.initial_state(server)
    assert state, "Nesterov keeps its momentum beside W_s"
    before = {k: v.copy() for k, v in state.items()}
    moved = merged_alone(policy, rule, server, state, _update([3.0, 4.0]))

    merged, merged_state = {k: v.copy() for k, v in server.items()}, {k: v.copy() for k, v in state.items()}
    assert apply_with_policy(policy, rule, merged, merged_state, _update([3.0, 4.0]), 10, 5.0, [], 10.0) is None
    np.testing.assert_allclose(moved["w"], merged["w"], rtol=1e-6)  # clipped to norm 1, then the Nesterov step
    np.testing.assert_array_equal(server["w"], [0.0, 0.0])
    for k, v in before.items():
        np.testing.assert_array_equal(state[k], v)


def test_w_s_diverged_only_when_its_latest_losses_all_stay_above_a_multiple_of_its_lowest() -> None:
    policy = Policy.from_spec({"divergence_factor": 3.0, "divergence_patience": 3})
    assert policy.divergence(0.3, [0.35, 1.2, 0.31]) is None, "one bad evaluation is noise"
    assert policy.divergence(0.3, [1.0, 1.5]) is None, "fewer evaluations than the patience"
    why = policy.divergence(0.3, [0.4, 1.0, 2.5, float("nan")])
    assert why is not None and "above 3 x its lowest, 0.3" in why
    assert policy.divergence(0.25, [0.8, 0.76, 0.9]) is not None and policy.divergence(0.25, [0.8, 0.75, 0.9]) is None
    assert Policy.from_spec({"divergence_factor": None}).divergence(0.3, [9.0] * 5) is None
    assert policy.divergence(float("inf"), [9.0] * 5) is None, "no evaluation finite yet: nothing to compare with"
