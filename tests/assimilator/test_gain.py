"""The `gain` staleness weight of the delta rule (crowdtrain.assimilator.rules.gain): AdaScale's gain
r(S) over the stream of updates, so that agreeing updates share one step and noisy ones each take
theirs."""

import numpy as np
import pytest

from crowdtrain.assimilator.rules import GainDelta, Update, make_rule
from crowdtrain.assimilator.rules.gain import WARMUP, gain
from crowdtrain.assimilator.rules.outer import make_outer
from crowdtrain.core.assimilationspec import assimilation_of

SIZE = 4096


def test_the_gain_runs_from_one_for_agreeing_updates_to_s_for_pure_noise() -> None:
    assert gain(0.0, 1.0, 8) == 1.0
    assert gain(1.0, 0.0, 8) == 8.0
    assert gain(1.0, 1.0, 8) == pytest.approx(2 / (1 / 8 + 1))
    assert gain(5.0, 0.0, 1) == 1.0 and gain(0.0, 0.0, 8) == 1.0


def _weights(updates: list[np.ndarray], staleness: int) -> list[float]:
    """The weight each update got, read back from how far W_s moved along it."""
    rule = GainDelta(make_outer("none", 1.0, 0.9, 4, (0.9, 0.99), 1e-8))
    server = {"w": np.zeros(SIZE, np.float32)}
    state = rule.initial_state(server)
    weights = []
    for d in updates:
        before = server["w"].copy()
        rule.apply(server, state, Update({"w": before + d}, {"w": d}, staleness, 1))
        weights.append(float(np.dot(server["w"] - before, d) / np.dot(d, d)))
    return weights


def test_updates_that_repeat_one_another_share_one_step() -> None:
    rng = np.random.default_rng(0)
    direction = rng.normal(size=SIZE).astype(np.float32)
    updates = [direction + 0.01 * rng.normal(size=SIZE).astype(np.float32) for _ in range(40)]
    weights = _weights(updates, staleness=7)
    assert weights[:WARMUP] == pytest.approx([1 / 8] * WARMUP, rel=1e-4), "cautious until the noise is measured"
    assert weights[-1] == pytest.approx(1 / 8, rel=0.05)


def test_updates_that_are_mostly_noise_each_take_their_step() -> None:
    rng = np.random.default_rng(1)
    direction = 0.05 * rng.normal(size=SIZE).astype(np.float32)
    updates = [direction + rng.normal(size=SIZE).astype(np.float32) for _ in range(60)]
    weights = _weights(updates, staleness=7)
    assert weights[-1] > 0.7, weights[-10:]


def test_the_gain_weight_belongs_to_the_delta_rule() -> None:
    assert isinstance(make_rule({"rule": "delta", "staleness_weight": "gain"}), GainDelta)
    with pytest.raises(ValueError, match="staleness_weight\n  Input should be 'constant', 'polynomial' or 'hinge'"):
        assimilation_of(dict(rule="fedbuff", staleness_weight="gain"))
