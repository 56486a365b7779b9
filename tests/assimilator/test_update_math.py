"""The arithmetic under every merge: ||Δ|| as BLAS sums it, and an update scaled by several weights
without model-sized copies, equal to the bit to scaling it by each weight in turn."""

import math

import numpy as np

from crowdtrain.assimilator.rules.update import NORM_BLOCK, Scaled, params_norm, sum_of_squares


def _exact(x: np.ndarray) -> float:
    return math.fsum(float(v) * float(v) for v in x.astype(np.float64))


def test_a_float32_sum_of_squares_is_within_a_millionth_of_the_exact_sum() -> None:
    x = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)  # not a multiple of a block
    buffer = np.empty(NORM_BLOCK, np.float64)

    assert math.isclose(sum_of_squares(x, buffer), _exact(x), rel_tol=1e-6)


def test_squares_past_float32_s_range_are_summed_in_float64_not_reported_infinite() -> None:
    x = np.full(10_000, 1e20, np.float32)  # each square is 1e40: infinite in float32, finite in float64
    buffer = np.empty(NORM_BLOCK, np.float64)

    assert math.isclose(sum_of_squares(x, buffer), 10_000 * float(np.float32(1e20)) ** 2, rel_tol=1e-9)
    assert math.isnan(sum_of_squares(np.array([1.0, np.nan], np.float32), buffer)), "NaN stays NaN"


def test_other_dtypes_and_strided_views_take_the_float64_path() -> None:
    rng = np.random.default_rng(1)
    half = rng.standard_normal(5_000).astype(np.float16)
    strided = rng.standard_normal(20_000).astype(np.float32)[::2]
    buffer = np.empty(NORM_BLOCK, np.float64)

    assert math.isclose(sum_of_squares(half, buffer), _exact(half), rel_tol=1e-12)
    assert math.isclose(sum_of_squares(strided, buffer), _exact(strided), rel_tol=1e-12)
    assert math.isclose(params_norm({"h": half, "n": np.arange(3)}), _exact(half) ** 0.5, rel_tol=1e-12)


def test_an_update_scaled_twice_equals_scaling_a_copy_twice_to_the_bit_and_copies_nothing_itself() -> None:
    rng = np.random.default_rng(2)
    delta = {"w": rng.standard_normal((300, 7)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float64)}
    kept = {k: v.copy() for k, v in delta.items()}
    c, w, lr = 1 / 16, 0.7071067811865476, 0.3

    scaled = Scaled(Scaled(Scaled(delta, c), w), lr)

    for name, d in delta.items():
        by_copies = ((d * np.asarray(c, d.dtype)) * np.asarray(w, d.dtype)) * np.asarray(lr, d.dtype)
        np.testing.assert_array_equal(scaled[name], by_copies)
        assert scaled[name].dtype == d.dtype
    assert scaled.unscaled is delta and list(scaled) == ["w", "b"] and len(scaled) == 2
    for name in delta:
        np.testing.assert_array_equal(delta[name], kept[name])  # reading never changes what it scales
    assert Scaled(delta, 1.0)["w"] is delta["w"], "a weight of 1 forms nothing"
