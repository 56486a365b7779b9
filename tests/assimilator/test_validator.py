"""The replica validator as a pure function: agreement by direction, norm and held-out loss."""

import numpy as np
import pytest

from crowdtrain.assimilator.validator import Replica, cosines, flat_update, judge, training_z
from crowdtrain.core.validationspec import ValidationSpec

SPEC = ValidationSpec(replicate_untrusted=True)
BASE_LOSS = 1.0


def _replicas(*rows: tuple[int, list[float], float]) -> tuple[list[Replica], dict]:
    """(assignment id, update vector, held-out loss) -> the replicas and their pairwise cosines."""
    updates = {i: np.array(v, dtype=np.float64) for i, v, _ in rows}
    replicas = [Replica(i, float(np.linalg.norm(updates[i])), loss) for i, _, loss in rows]
    return replicas, cosines(updates)


def test_two_agreeing_replicas_are_valid_and_the_lower_loss_is_merged() -> None:
    replicas, cos = _replicas((1, [1.0, 0.1], 0.8), (2, [0.9, 0.2], 0.75))
    verdict = judge(replicas, cos, BASE_LOSS, SPEC)
    assert verdict.decided and set(verdict.valid) == {1, 2} and verdict.canonical == 2 and not verdict.invalid


@pytest.mark.parametrize(
    ("hostile", "loss", "reason"),
    [
        ([-1.0, -0.1], 0.8, "cosine"),  # sign-flipped
        ([10.0, 1.0], 0.8, "norm ratio"),  # scaled
        ([0.1, -1.0], 0.8, "cosine"),  # noise of plausible norm, another direction
        ([1.0, 0.1], 0.4, "held-out losses"),  # same update, a loss that cannot be the same model's
    ],
    ids=["sign-flipped", "scaled", "noise", "loss"],
)
def test_two_disagreeing_replicas_ask_for_a_third_which_settles_it(hostile, loss, reason) -> None:
    honest = (1, [1.0, 0.1], 0.8)
    replicas, cos = _replicas(honest, (2, hostile, loss))
    assert judge(replicas, cos, BASE_LOSS, SPEC).more

    replicas, cos = _replicas(honest, (2, hostile, loss), (3, [0.95, 0.15], 0.82))
    verdict = judge(replicas, cos, BASE_LOSS, SPEC)
    assert set(verdict.valid) == {1, 3} and verdict.canonical == 1
    assert list(verdict.invalid) == [2] and reason in verdict.invalid[2] and verdict.charged == {2}


@pytest.mark.parametrize(
    ("update", "loss", "reason"),
    [([0.0, 0.0], 1.0, "zero"), ([1.0, 0.1], 1.6, "held-out loss"), ([1.0, 0.1], float("nan"), "not finite")],
    ids=["lazy", "worse-than-base", "nan"],
)
def test_an_implausible_replica_is_invalid_whatever_the_others_say(update, loss, reason) -> None:
    replicas, cos = _replicas((1, [1.0, 0.1], 0.8), (2, update, loss), (3, [0.9, 0.1], 0.8))
    verdict = judge(replicas, cos, BASE_LOSS, SPEC)
    assert set(verdict.valid) == {1, 3} and reason in verdict.invalid[2] and 2 in verdict.charged


def test_no_agreement_at_the_bound_is_inconclusive_and_charges_only_the_implausible() -> None:
    replicas, cos = _replicas((1, [1.0, 0.0], 0.8), (2, [0.0, 1.0], 0.8), (3, [0.0, 0.0], 0.8))
    verdict = judge(replicas, cos, BASE_LOSS, SPEC)
    assert verdict.decided and verdict.canonical is None and not verdict.valid
    assert set(verdict.invalid) == {1, 2, 3} and verdict.charged == {3} and "inconclusive" in verdict.invalid[1]


def test_a_colluding_majority_wins_the_vote() -> None:
    """What the validator cannot catch: two hostile replicas that agree outvote one honest one."""
    replicas, cos = _replicas((1, [1.0, 0.1], 0.8), (2, [-1.0, -0.1], 0.9), (3, [-1.0, -0.12], 0.9))
    verdict = judge(replicas, cos, BASE_LOSS, SPEC)
    assert set(verdict.valid) == {2, 3} and 1 in verdict.invalid


def test_flat_updates_take_float_tensors_in_name_order() -> None:
    delta = {"b": np.array([3.0], dtype=np.float32), "a": np.array([[1.0, 2.0]]), "n": np.array([7], dtype=np.int64)}
    assert flat_update(delta).tolist() == [1.0, 2.0, 3.0]
    assert cosines({1: np.array([1.0, 0.0]), 2: np.array([0.0, 0.0])}) == {(1, 2): 0.0}


def test_training_z_tells_a_fitted_shard_from_an_untrained_direction() -> None:
    """Training lowers most of its shard's losses, though a few may rise a lot late in training (a
    mean of loss gains would cancel out there); a random direction raises as many as it lowers."""
    rng = np.random.default_rng(0)
    before = rng.uniform(0.05, 2.0, 512)
    trained = before * 0.8
    trained[:20] += 8.0  # a few examples fitted worse, by much
    assert (before - trained).mean() < 0, "the mean loss rose: a loss z would refuse this result"
    assert training_z(before, trained) > 10
    untrained = before * np.exp(rng.normal(0.0, 0.1, 512))
    assert abs(training_z(before, untrained)) < 3
    assert training_z(before, before) == 0.0 and training_z(before[:1], before[:1] / 2) == 0.0


def test_a_colluding_pair_that_shows_no_training_is_refused_at_once_and_charged() -> None:
    """Two replicas that agree on a direction neither trained: both implausible, and no third replica
    could make two plausible ones agree, so the vote ends now, inconclusive, both charged."""
    pair = [Replica(1, 1.0, 0.8, training_z=0.4), Replica(2, 1.02, 0.8, training_z=-1.0)]
    verdict = judge(pair, {(1, 2): 0.99}, BASE_LOSS, SPEC)
    assert verdict.decided and verdict.canonical is None and not verdict.valid
    assert verdict.charged == {1, 2} and all("shows no training" in why for why in verdict.invalid.values())
    honest = Replica(3, 1.0, 0.8, training_z=30.0)
    assert judge([pair[0], honest], {(1, 3): 0.99}, BASE_LOSS, SPEC).more, "one honest replica waits for another"
    unchecked = SPEC.model_copy(update={"min_training_z": None})
    assert set(judge(pair, {(1, 2): 0.99}, BASE_LOSS, unchecked).valid) == {1, 2}, "what the check is for"


def test_a_pair_whose_update_does_not_descend_the_shard_is_refused_even_with_a_high_training_z() -> None:
    """A random direction can raise a shard's probabilities by chance (training z 6 at an initial
    model): the descent evidence refuses the pair all the same, and an honest replica passes both."""
    pair = [Replica(i, 1.0, 0.8, training_z=6.0, descent_z=z) for i, z in ((1, 1.2), (2, 0.9))]
    verdict = judge(pair, {(1, 2): 0.99}, BASE_LOSS, SPEC)
    assert verdict.decided and not verdict.valid and verdict.charged == {1, 2}
    assert all("shows no training" in why and "descent z" in why for why in verdict.invalid.values())
    honest = [Replica(i, 1.0, 0.8, training_z=20.0, descent_z=12.0) for i in (3, 4)]
    late = Replica(5, 1.0, 0.8, training_z=SPEC.training_z_alone, descent_z=1.0)  # strong enough alone
    assert judge([honest[0], late], {(3, 5): 0.9}, BASE_LOSS, SPEC).valid
    assert set(judge(honest, {(3, 4): 0.9}, BASE_LOSS, SPEC).valid) == {3, 4}
    unchecked = SPEC.model_copy(update={"min_descent_z": None})
    assert set(judge(pair, {(1, 2): 0.99}, BASE_LOSS, unchecked).valid) == {1, 2}, "what the check is for"
