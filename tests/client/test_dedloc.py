"""The DeDLOC peer's pieces: a failed reduction leaves the gradients intact; the state codec."""

import pytest
import torch
from pydantic import ValidationError

from crowdtrain.client.dedloc.allreduce import reduce_round
from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.client.dedloc.state import encode_state, load_state, make_optimizer
from crowdtrain.core import dedloc
from crowdtrain.core.schemas_dedloc import PeerJoined, RoundPlanOut
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.launch.cluster import free_port


@pytest.mark.parametrize("relayed", [True, False], ids=["relayed", "gloo-group"])
def test_a_failed_reduction_leaves_the_accumulated_gradients_intact(relayed: bool) -> None:
    api = PeerAPI(f"http://127.0.0.1:{free_port()}", timeout=2)  # nothing listens: every request fails
    api.job_id, api.peer_id = 1, "a"
    plan = RoundPlanOut(
        step=0,
        attempt=0,
        members=["a", "b"],
        examples={"a": 3, "b": 5},
        total=8,
        relayed=relayed,
        group=None if relayed else 0,
        group_members=[] if relayed else ["a", "b"],
        rank=None if relayed else 0,
        needs_combining=relayed,
        parts=["relay-a", "group-0"],
        averaging_timeout=5,
    )
    grads = torch.arange(10, dtype=torch.float32)
    kept = grads.clone()
    with pytest.raises(Exception):  # noqa: B017  # any failure: Gloo's and the HTTP client's differ
        reduce_round(api, plan, grads)
    assert torch.equal(grads, kept)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_state_restores_parameters_and_optimizer_so_the_next_step_is_identical(optimizer: str) -> None:
    spec = {"optimizer": optimizer, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}

    def model_and_opt():
        m = build_model("mlp", [8], 3, seed=1, hidden=[4])
        return m, make_optimizer(m, spec)

    def step(m, opt, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(torch.randn(5, 8, generator=g)), torch.tensor([0, 1, 2, 0, 1])).backward()
        opt.step()

    a, opt_a = model_and_opt()
    step(a, opt_a, 0)
    blob = encode_state(a, opt_a)
    b, opt_b = model_and_opt()
    load_state(b, opt_b, blob)
    params_only, opt_c = model_and_opt()  # control: the same parameters without the optimizer state
    params_only.load_state_dict(a.state_dict())
    for m, opt in ((a, opt_a), (b, opt_b), (params_only, opt_c)):
        step(m, opt, 1)
    assert dedloc.digest(state_to_numpy(a)) == dedloc.digest(state_to_numpy(b))
    assert dedloc.digest(state_to_numpy(a)) != dedloc.digest(state_to_numpy(params_only))


@pytest.mark.parametrize("peer_id", ["../../v1/admin/hosts", "h1/x", "h1?x=1", ""])
def test_a_peer_id_that_would_change_the_peers_urls_is_refused(peer_id: str) -> None:
    with pytest.raises(ValidationError, match="peer_id"):
        PeerJoined.model_validate(
            {"peer_id": peer_id, "job_id": 1, "recipe": {}, "shards": [], "step": 0, "state_step": 0}
        )
