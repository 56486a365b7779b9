import numpy as np
import pytest

from assimilator.rules import alpha_for_epoch, merge_vc_asgd, update_norm


def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32),
            "count": np.array(7, dtype=np.int64)}


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("n", [1, 2, 10])
def test_vc_asgd_over_n_merges_equals_closed_form(alpha: float, n: int) -> None:
    rng = np.random.default_rng(n)
    w0 = _params(rng)
    clients = [_params(rng) for _ in range(n)]
    ws = {k: v.copy() for k, v in w0.items()}
    for wc in clients:
        ws = merge_vc_asgd(ws, wc, alpha)
    for name in ("w", "b"):
        expected = alpha ** n * w0[name].astype(np.float64) + (1 - alpha) * sum(
            alpha ** (n - k) * clients[k - 1][name].astype(np.float64) for k in range(1, n + 1))
        np.testing.assert_allclose(ws[name], expected, rtol=1e-5, atol=1e-6)
    assert ws["count"] == w0["count"], "integer tensors keep the server's value"


def test_in_place_merge_matches_copying_merge_and_leaves_client_untouched() -> None:
    rng = np.random.default_rng(0)
    ws, wc = _params(rng), _params(rng)
    client_before = {k: v.copy() for k, v in wc.items()}
    copied = merge_vc_asgd(ws, wc, 0.6)
    in_place = merge_vc_asgd({k: v.copy() for k, v in ws.items()}, wc, 0.6, out=None)
    target = {k: v.copy() for k, v in ws.items()}
    result = merge_vc_asgd(target, wc, 0.6, out=target)
    assert result["w"] is target["w"]
    for k in ws:
        np.testing.assert_array_equal(copied[k], in_place[k])
        np.testing.assert_array_equal(copied[k], result[k])
        np.testing.assert_array_equal(wc[k], client_before[k])


def test_alpha_bounds_are_checked() -> None:
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError):
        merge_vc_asgd(_params(rng), _params(rng), 1.5)


@pytest.mark.parametrize(("epoch", "expected"), [(1, 0.5), (2, 2 / 3), (9, 0.9), (99, 0.99)])
def test_epoch_schedule_is_e_over_e_plus_one(epoch: int, expected: float) -> None:
    assert alpha_for_epoch("epoch", 0.123, epoch) == pytest.approx(expected)


def test_constant_schedule_ignores_the_epoch() -> None:
    assert {alpha_for_epoch("constant", 0.7, e) for e in range(1, 20)} == {0.7}


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError):
        alpha_for_epoch("epoch", 0.5, 0)
    with pytest.raises(ValueError):
        alpha_for_epoch("cosine", 0.5, 1)


def test_update_norm() -> None:
    a = {"w": np.zeros(4, np.float32), "n": np.array(1)}
    b = {"w": np.array([3, 4, 0, 0], np.float32), "n": np.array(5)}
    assert update_norm(a, b) == pytest.approx(5.0)
