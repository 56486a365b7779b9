"""The modules of a mixture-of-experts model (crowdtrain.core.zoo_experts): the trunk the zoo builds,
and the mixture layers computed with every expert at hand (the parameter servers' evaluation)."""

import numpy as np
import pytest
import torch

from crowdtrain.core import zoo
from crowdtrain.core.experts import EXPERT_PREFIX, ExpertLayout
from crowdtrain.core.zoo_experts import MixtureTrunk, build_expert, local_experts

LAYOUT = ExpertLayout(layers=2, grid=[2, 3], dim=6, hidden=12, k=3, k_min=2)


def reference_layer(gate, x: torch.Tensor, experts: dict) -> torch.Tensor:
    """One layer by its definition, row by row: the k best experts by the gate's score, weighted by a
    softmax over their scores."""
    uids = LAYOUT.uids(0)
    coords = torch.tensor([[int(c) for c in u.split(".")[1:]] for u in uids])
    scores = gate(x, coords)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        top = scores[row].topk(LAYOUT.k)
        weights = torch.softmax(top.values, dim=0)
        out[row] = sum(
            w * experts[uids[e]](x[row : row + 1])[0] for w, e in zip(weights, top.indices.tolist(), strict=True)
        )
    return out


def test_the_zoo_builds_the_trunk_whose_state_is_the_dense_part_only() -> None:
    trunk = zoo.build_model("moe", [8], 10, seed=0, layout=LAYOUT.model_dump(mode="json"))
    assert isinstance(trunk, MixtureTrunk)
    names = set(trunk.state_dict())
    assert {n.split(".")[0] for n in names} == {"embed", "norms", "gates", "head"}
    # Without experts each mixture layer adds nothing: the scheduler's shape check, on the meta device too.
    assert trunk(torch.zeros(3, 8)).shape == (3, 10)
    assert zoo.check_model("moe", [8], 10, {"layout": LAYOUT.model_dump(mode="json")}, 1 << 20) > 0


def test_local_experts_compute_each_rows_best_experts_weighted_by_their_scores() -> None:
    torch.manual_seed(0)
    trunk = MixtureTrunk([8], 10, LAYOUT.model_dump())
    trained = {u: build_expert(LAYOUT, u, seed=7) for u in LAYOUT.uids(0)}
    params = {
        f"{EXPERT_PREFIX}{u}/{name}": t.detach().numpy()
        for u, e in trained.items()
        for name, t in e.state_dict().items()
    }
    experts = local_experts(LAYOUT, params)
    x = torch.randn(20, LAYOUT.dim)
    with torch.no_grad():
        got = experts(0, trunk.gates[0], x)
        expected = reference_layer(trunk.gates[0], x, trained)
        initial = reference_layer(trunk.gates[0], x, {u: build_expert(LAYOUT, u) for u in LAYOUT.uids(0)})
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, initial)  # the given weights were used, not the initial ones


@pytest.mark.parametrize("bad", ["nan", "shape", "missing"])
def test_an_experts_weights_that_do_not_fit_it_give_way_to_its_initial_weights(bad: str) -> None:
    uid = "0.1.2"
    weights = {n: t.detach().numpy().copy() for n, t in build_expert(LAYOUT, uid, seed=7).state_dict().items()}
    name = next(iter(weights))
    if bad == "nan":
        weights[name][...] = np.nan
    elif bad == "shape":
        weights[name] = np.zeros((1, 1), np.float32)
    else:
        del weights[name]
    experts = local_experts(LAYOUT, {f"{EXPERT_PREFIX}{uid}/{n}": v for n, v in weights.items()})
    initial = build_expert(LAYOUT, uid)
    for mine, theirs in zip(experts.experts[uid].state_dict().values(), initial.state_dict().values(), strict=True):
        torch.testing.assert_close(mine, theirs)
