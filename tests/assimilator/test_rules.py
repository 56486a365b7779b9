import numpy as np
import pytest
import torch

from crowdtrain.assimilator.rules import (
    Delta,
    FedBuff,
    LossControlled,
    StalenessWeight,
    Update,
    VcAsgd,
    alpha_for_epoch,
    make_rule,
    merge_vc_asgd,
    update_norm,
)
from crowdtrain.assimilator.rules.combiners import combine
from crowdtrain.assimilator.rules.outer import Nesterov
from crowdtrain.core.jobspec import JobSpec, load_job_spec
from tests.conftest import EXAMPLE_SPEC


def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
        "count": np.array(7, dtype=np.int64),
    }


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
        expected = alpha**n * w0[name].astype(np.float64) + (1 - alpha) * sum(
            alpha ** (n - k) * clients[k - 1][name].astype(np.float64) for k in range(1, n + 1)
        )
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


# ---- delta, fedbuff, staleness weights, combiners, outer optimizers -------------------------------------------


def _update(delta: dict[str, np.ndarray], staleness: int = 0) -> Update:
    return Update(client={}, delta=delta, staleness=staleness, epoch=1)


def _deltas(rng: np.random.Generator, n: int) -> list[dict[str, np.ndarray]]:
    return [
        {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
        for _ in range(n)
    ]


def _run(rule, w0: dict[str, np.ndarray], updates: list[Update]) -> tuple[dict, dict]:
    server = {k: v.copy() for k, v in w0.items()}
    state = rule.initial_state(server)
    for u in updates:
        rule.apply(server, state, u)
    return server, state


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_delta_with_constant_weight_and_no_staleness_is_plain_summation(server_lr: float) -> None:
    rng = np.random.default_rng(3)
    w0, deltas = _params(rng), _deltas(rng, 6)
    rule = make_rule({"rule": "delta", "server_lr": server_lr})
    server, state = _run(rule, w0, [_update(d) for d in deltas])
    assert state == {}, "plain delta keeps no state"
    for name in ("w", "b"):
        expected = w0[name].astype(np.float64) + server_lr * sum(d[name].astype(np.float64) for d in deltas)
        np.testing.assert_allclose(server[name], expected, rtol=1e-5, atol=1e-6)
    assert server["count"] == w0["count"], "integer tensors keep the server's value"


@pytest.mark.parametrize(
    ("kind", "a", "b", "tau", "expected"),
    [
        ("constant", 0.5, 4, 0, 1.0),
        ("constant", 0.5, 4, 1000, 1.0),
        ("polynomial", 0.5, 4, 0, 1.0),
        ("polynomial", 0.5, 4, 3, 0.5),
        ("polynomial", 1.0, 4, 9, 0.1),
        ("polynomial", 0.0, 4, 9, 1.0),
        ("hinge", 0.5, 4, 0, 1.0),
        ("hinge", 0.5, 4, 4, 1.0),
        ("hinge", 0.5, 4, 6, 0.5),
        ("hinge", 2.0, 1, 3, 0.2),
    ],
)
def test_staleness_weights_follow_fedasync(kind: str, a: float, b: int, tau: int, expected: float) -> None:
    assert StalenessWeight(kind, a, b)(tau) == pytest.approx(expected)


def test_delta_scales_each_update_by_its_staleness_weight() -> None:
    rng = np.random.default_rng(4)
    w0, (d,) = _params(rng), _deltas(rng, 1)
    rule = make_rule({"rule": "delta", "server_lr": 0.8, "staleness_weight": "polynomial", "staleness_a": 0.5})
    server, _ = _run(rule, w0, [_update(d, staleness=3)])
    np.testing.assert_allclose(server["w"], w0["w"] + 0.8 * 0.5 * d["w"], rtol=1e-6)


def test_an_unknown_staleness_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="staleness_weight"):
        StalenessWeight("exponential")


@pytest.mark.parametrize("outer", ["none", "nesterov", "delayed-nesterov", "adam"])
def test_fedbuff_with_a_buffer_of_one_is_delta(outer: str) -> None:
    rng = np.random.default_rng(5)
    w0, deltas = _params(rng), _deltas(rng, 7)
    updates = [_update(d, staleness=i % 4) for i, d in enumerate(deltas)]
    common = {
        "server_lr": 0.3,
        "staleness_weight": "hinge",
        "staleness_a": 0.5,
        "staleness_b": 1,
        "outer_optimizer": outer,
        "nesterov_delay": 2,
    }
    by_delta, delta_state = _run(make_rule(common | {"rule": "delta"}), w0, updates)
    by_fedbuff, fedbuff_state = _run(make_rule(common | {"rule": "fedbuff", "buffer_size": 1}), w0, updates)
    for name in w0:
        np.testing.assert_array_equal(by_fedbuff[name], by_delta[name])
    for name, value in delta_state.items():
        np.testing.assert_array_equal(fedbuff_state[name], value)


@pytest.mark.parametrize("combiner", ["mean", "median", "trimmed-mean"])
def test_fedbuff_steps_once_every_k_updates_with_their_combination(combiner: str) -> None:
    rng = np.random.default_rng(6)
    w0, deltas = _params(rng), _deltas(rng, 6)
    rule = make_rule(
        {"rule": "fedbuff", "buffer_size": 3, "combiner": combiner, "trim_fraction": 0.34, "server_lr": 0.5}
    )
    server = {k: v.copy() for k, v in w0.items()}
    state = rule.initial_state(server)
    expected = {k: v.astype(np.float64) for k, v in w0.items() if v.dtype.kind == "f"}
    for i, d in enumerate(deltas):
        rule.apply(server, state, _update(d))
        if i % 3 < 2:
            assert int(state["buffer.count"]) == i % 3 + 1
            continue
        batch = deltas[i - 2 : i + 1]
        for name in expected:
            stacked = np.stack([b[name] for b in batch]).astype(np.float64)
            combined = stacked.mean(axis=0) if combiner == "mean" else np.median(stacked, axis=0)
            expected[name] += 0.5 * combined  # with 3 values, trimming one at each end leaves the median
        assert int(state["buffer.count"]) == 0
    for name, value in expected.items():
        np.testing.assert_allclose(server[name], value, rtol=1e-5, atol=1e-6)


def test_combiners_on_known_arrays() -> None:
    arrays = [
        np.array([1.0, -2.0, 0.0], np.float32),
        np.array([5.0, 2.0, 0.0], np.float32),
        np.array([2.0, 100.0, 0.0], np.float32),
        np.array([100.0, 0.0, 4.0], np.float32),
        np.array([3.0, 1.0, 1.0], np.float32),
    ]
    np.testing.assert_allclose(combine("mean", arrays), [22.2, 20.2, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(combine("median", arrays), [3.0, 1.0, 0.0])
    # 5 values, trim 0.2: the smallest and the largest of each coordinate go.
    np.testing.assert_allclose(combine("trimmed-mean", arrays, 0.2), [10 / 3, 1.0, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(combine("trimmed-mean", arrays, 0.1), combine("mean", arrays), rtol=1e-6)
    assert combine("median", arrays[:2]).dtype == np.float32
    np.testing.assert_array_equal(combine("median", arrays[:2]), [3.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="trim_fraction"):
        combine("trimmed-mean", arrays, 0.5)


def _torch_outer(optimizer_factory, w0: dict[str, np.ndarray], updates: list[dict[str, np.ndarray]]) -> dict:
    """W after torch's optimizer has stepped on the pseudo-gradient g = −u of each update u."""
    names = [k for k, v in w0.items() if v.dtype.kind == "f"]
    tensors = {k: torch.nn.Parameter(torch.from_numpy(w0[k].copy())) for k in names}
    opt = optimizer_factory(list(tensors.values()))
    for u in updates:
        for k in names:
            tensors[k].grad = torch.from_numpy(-u[k])
        opt.step()
    return {k: t.detach().numpy() for k, t in tensors.items()}


def test_outer_nesterov_equals_torch_sgd_with_nesterov_on_the_negated_update() -> None:
    rng = np.random.default_rng(7)
    w0, deltas = _params(rng), _deltas(rng, 8)
    rule = make_rule({"rule": "delta", "outer_optimizer": "nesterov", "server_lr": 0.7, "outer_momentum": 0.9})
    server, state = _run(rule, w0, [_update(d) for d in deltas])
    expected = _torch_outer(lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True), w0, deltas)
    for name, value in expected.items():
        np.testing.assert_allclose(server[name], value, rtol=1e-5, atol=1e-6)
    assert int(state["step"]) == 8
    assert server["count"] == w0["count"]


def test_outer_adam_equals_torch_adam_on_the_staleness_weighted_negated_update() -> None:
    rng = np.random.default_rng(8)
    w0, deltas = _params(rng), _deltas(rng, 8)
    stalenesses = [0, 3, 1, 8, 0, 2, 15, 0]
    rule = make_rule(
        {
            "rule": "delta",
            "outer_optimizer": "adam",
            "server_lr": 0.01,
            "adam_betas": (0.8, 0.95),
            "adam_eps": 1e-6,
            "staleness_weight": "polynomial",
            "staleness_a": 0.5,
        }
    )
    server, state = _run(rule, w0, [_update(d, tau) for d, tau in zip(deltas, stalenesses, strict=True)])
    gated = [
        {k: v * np.float32((1 + tau) ** -0.5) for k, v in d.items()} for d, tau in zip(deltas, stalenesses, strict=True)
    ]
    expected = _torch_outer(lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6), w0, gated)
    for name, value in expected.items():
        np.testing.assert_allclose(server[name], value, rtol=1e-5, atol=1e-6)
    assert int(state["step"]) == 8


def _delayed_nesterov_reference(w0: np.ndarray, gs: list[np.ndarray], lr: float, beta: float, n: int) -> np.ndarray:
    """Liu et al. 2024's delayed Nesterov update (Algorithm 3) written out plainly, in float64."""
    w, m, pending = w0.astype(np.float64), np.zeros(w0.shape), np.zeros(w0.shape)
    for t, g in enumerate(gs, start=1):
        pending = pending + g
        if t % n == 0:
            m = beta * m + pending / n
            w = w - lr * (g / n + beta * m)
            pending = np.zeros(w0.shape)
        else:
            w = w - lr * g / n
    return w


@pytest.mark.parametrize("delay", [1, 3])
def test_delayed_nesterov_moves_its_momentum_only_every_n_updates(delay: int) -> None:
    rng = np.random.default_rng(9)
    w0, deltas = _params(rng), _deltas(rng, 7)
    spec = {
        "rule": "delta",
        "outer_optimizer": "delayed-nesterov",
        "server_lr": 0.5,
        "outer_momentum": 0.8,
        "nesterov_delay": delay,
    }
    server, state = _run(make_rule(spec), w0, [_update(d) for d in deltas])
    for name in ("w", "b"):
        expected = _delayed_nesterov_reference(w0[name], [-d[name] for d in deltas], 0.5, 0.8, delay)
        np.testing.assert_allclose(server[name], expected, rtol=1e-5, atol=1e-6)
    assert int(state["step"]) == 7
    if delay == 1:  # with a delay of one it is the Nesterov step
        nesterov, _ = _run(make_rule(spec | {"outer_optimizer": "nesterov"}), w0, [_update(d) for d in deltas])
        for name in ("w", "b"):
            np.testing.assert_allclose(server[name], nesterov[name], rtol=1e-6, atol=1e-7)


def test_rule_state_is_named_arrays_of_fixed_shapes() -> None:
    w0 = _params(np.random.default_rng(10))
    state = make_rule({"rule": "fedbuff", "buffer_size": 2, "outer_optimizer": "adam"}).initial_state(w0)
    assert set(state) == {
        "buffer.0.w",
        "buffer.0.b",
        "buffer.1.w",
        "buffer.1.b",
        "buffer.count",
        "adam.m.w",
        "adam.m.b",
        "adam.v.w",
        "adam.v.b",
        "step",
    }
    assert state["step"].shape == () and state["step"].dtype == np.int64
    assert state["adam.m.w"].shape == (4, 3)


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        ({"rule": "vc-asgd"}, VcAsgd),
        ({"rule": "delta"}, Delta),
        ({"rule": "fedbuff", "outer_optimizer": "nesterov"}, FedBuff),
        ({}, LossControlled),  # the default configuration: delta with step_control loss
    ],
)
def test_make_rule_picks_the_rule_of_the_spec(spec: dict, kind: type) -> None:
    assert isinstance(make_rule(spec), kind)


def test_make_rule_refuses_an_outer_optimizer_for_vc_asgd_naming_the_field() -> None:
    with pytest.raises(ValueError, match="outer_optimizer"):
        make_rule({"rule": "vc-asgd", "outer_optimizer": "nesterov"})


def test_a_job_spec_with_fedbuff_and_outer_nesterov_validates_and_builds_its_rule() -> None:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    data["assimilation"] = {
        "rule": "fedbuff",
        "buffer_size": 3,
        "combiner": "trimmed-mean",
        "outer_optimizer": "nesterov",
        "server_lr": 0.7,
        "outer_momentum": 0.9,
    }
    spec = JobSpec.model_validate(data)
    rule = make_rule(spec.model_dump(mode="json")["assimilation"])  # as the job table stores it
    assert isinstance(rule, FedBuff) and rule.size == 3 and rule.combiner == "trimmed-mean"
    assert rule.outer == Nesterov(lr=0.7, momentum=0.9)


def test_delayed_nesterov_over_n_updates_is_one_nesterov_step_on_their_mean() -> None:
    rng = np.random.default_rng(11)
    w0, deltas = _params(rng), _deltas(rng, 3)
    spec = {"rule": "delta", "server_lr": 0.5, "outer_momentum": 0.8}
    delayed, _ = _run(
        make_rule(spec | {"outer_optimizer": "delayed-nesterov", "nesterov_delay": 3}), w0, [_update(d) for d in deltas]
    )
    mean = {k: np.mean([d[k] for d in deltas], axis=0) for k in ("w", "b")}
    once, _ = _run(make_rule(spec | {"outer_optimizer": "nesterov"}), w0, [_update(mean)])
    for name in ("w", "b"):
        np.testing.assert_allclose(delayed[name], once[name], rtol=1e-5, atol=1e-6)
