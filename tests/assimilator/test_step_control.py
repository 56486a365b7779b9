"""`step_control: loss` (crowdtrain.assimilator.rules.control): the rule's step scaled by a factor that
grows while W_s's validation loss reaches new lows and halves when it rises, each evaluation counted once."""

import math

import numpy as np
import pytest
from pydantic import ValidationError

from crowdtrain.assimilator.rules import Delta, FedBuff, LossControlled, Update, make_rule, reads_validation
from crowdtrain.assimilator.rules.control import GROW, SHRINK
from crowdtrain.core.assimilationspec import assimilation_of

CONTROLLED = {"rule": "delta", "server_lr": 1.0, "step_control": "loss", "step_floor": 0.125}


def _step(rule: LossControlled, server: dict, state: dict, validation: tuple[int, float] | None) -> float:
    """How far W_s moved along one unit update, with the job's latest evaluation `validation`."""
    before = server["w"].copy()
    d = np.ones(4, np.float32)
    rule.apply(server, state, Update({"w": before + d}, {"w": d}, 0, 1, validation))
    return float((server["w"] - before)[0])


def test_the_step_starts_at_the_floor_grows_while_the_loss_falls_and_halves_at_a_rise() -> None:
    rule = make_rule(CONTROLLED)
    assert isinstance(rule, LossControlled) and isinstance(rule.inner, Delta)
    server = {"w": np.zeros(4, np.float32)}
    state = rule.initial_state(server)
    assert _step(rule, server, state, None) == pytest.approx(0.125)  # nothing evaluated yet
    assert _step(rule, server, state, (1, 2.0)) == pytest.approx(0.125 * GROW)  # the first loss
    assert _step(rule, server, state, (2, 1.5)) == pytest.approx(0.125 * GROW**2)  # lower than the previous
    assert _step(rule, server, state, (3, 1.55)) == pytest.approx(0.125 * GROW**2)  # higher, within 5%: noise
    assert _step(rule, server, state, (4, 1.54)) == pytest.approx(0.125 * GROW**3)  # lower than the previous
    for v in range(5, 40):
        _step(rule, server, state, (v, 1.0 / v))  # 35 more falls: c at 1, the inner rule's full step
    assert _step(rule, server, state, (40, 0.1)) == pytest.approx(SHRINK)  # 4x the previous: a rise
    assert _step(rule, server, state, (41, 0.15)) == pytest.approx(SHRINK**2)  # and another
    assert _step(rule, server, state, (42, 0.14)) == pytest.approx(SHRINK**2 * GROW, rel=1e-5)  # still above
    # the lowest, but falling: a bump is halved once per rise, not at every evaluation until it is gone
    assert _step(rule, server, state, (43, math.nan)) == pytest.approx(SHRINK**3 * GROW, rel=1e-5)
    assert _step(rule, server, state, (44, math.inf)) == pytest.approx(0.125)  # halved to the floor, no lower


def test_each_evaluation_counts_once_however_many_updates_see_it() -> None:
    rule = make_rule(CONTROLLED)
    server = {"w": np.zeros(4, np.float32)}
    state = rule.initial_state(server)
    steps = [_step(rule, server, state, (1, 1.0)) for _ in range(5)]
    assert steps == pytest.approx([0.125 * GROW] * 5)
    assert _step(rule, server, state, (0, 0.5)) == pytest.approx(0.125 * GROW)  # an older evaluation: ignored


def test_the_step_never_grows_past_the_inner_rules_own() -> None:
    rule = make_rule(CONTROLLED | {"server_lr": 0.5})
    server = {"w": np.zeros(4, np.float32)}
    state = rule.initial_state(server)
    steps = [_step(rule, server, state, (v, 10.0 / v)) for v in range(1, 60)]
    assert steps[-1] == pytest.approx(0.5, rel=1e-5)  # W_s is float32
    assert max(steps) == pytest.approx(0.5, rel=1e-5)


def test_a_buffered_rule_takes_the_controlled_step_on_its_combined_updates() -> None:
    rule = make_rule(CONTROLLED | {"rule": "fedbuff", "buffer_size": 2})
    assert isinstance(rule, LossControlled) and isinstance(rule.inner, FedBuff)
    server = {"w": np.zeros(4, np.float32)}
    state = rule.initial_state(server)
    assert _step(rule, server, state, None) == 0.0  # buffered
    assert _step(rule, server, state, None) == pytest.approx(0.125)  # the mean of two, scaled


def test_the_spec_refuses_step_control_where_no_step_is_taken_and_says_which_rules_read_the_loss() -> None:
    with pytest.raises(
        ValidationError, match="step_control is an option of rule delta and fedbuff, not of rule vc-asgd"
    ):
        assimilation_of({"rule": "vc-asgd", "step_control": "loss"})
    with pytest.raises(ValidationError, match="step_floor"):
        assimilation_of(CONTROLLED | {"step_floor": 0})
    assert reads_validation(CONTROLLED) and not reads_validation({"rule": "delta"})
