"""A mixture-of-experts layer over real expert hosts computes what the same layer computes with its
experts at hand, and, when a host dies, what it computes with the surviving experts renormalised."""

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from crowdtrain.client.experts.mixture import ExpertClient, RemoteExperts
from crowdtrain.core.experts import ExpertLayout, parse_uid
from crowdtrain.core.zoo_experts import GridGate, build_expert
from tests.client.experts.hosts import start_host

pytestmark = pytest.mark.integration

# A tiny learning rate: the hosts step their experts on each backward, and the reference does not.
LAYOUT = ExpertLayout(layers=1, grid=[2, 3], dim=6, hidden=12, k=3, k_min=2, lr=1e-12, max_rows=256)
HOST_A = ["0.0.0", "0.0.1", "0.0.2"]
HOST_B = ["0.1.0", "0.1.1", "0.1.2"]


def reference(gate: GridGate, x: torch.Tensor, alive: list[str]) -> torch.Tensor:
    """The layer's formula, with local copies of the experts: the k best of all experts by the gate's
    score, the dead ones dropped, a softmax over the rest; zero for rows with fewer than k_min left."""
    uids = sorted(LAYOUT.uids(0))
    coords = torch.tensor([parse_uid(u)[1] for u in uids])
    experts = {u: build_expert(LAYOUT, u) for u in uids}
    scores = copy.deepcopy(gate)(x, coords)
    top_scores, top = scores.topk(LAYOUT.k, dim=1)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        live = [(s, uids[e]) for s, e in zip(top_scores[row], top[row].tolist(), strict=True) if uids[e] in alive]
        if len(live) < LAYOUT.k_min:
            continue
        weights = torch.softmax(torch.stack([s for s, _ in live]), dim=0)
        out[row] = sum(w * experts[u](x[row : row + 1])[0] for w, (_, u) in zip(weights, live, strict=True))
    return out


@pytest.fixture
def hosts(tmp_path) -> Iterator[dict]:
    a, url_a = start_host(tmp_path, "a", LAYOUT, HOST_A)
    b, url_b = start_host(tmp_path, "b", LAYOUT, HOST_B)
    routes = {**dict.fromkeys(HOST_A, url_a), **dict.fromkeys(HOST_B, url_b)}
    client = ExpertClient(LAYOUT, routes)
    yield {"a": a, "b": b, "client": client, "routes": routes}
    client.close()
    a.stop()
    b.stop()


def test_the_layer_and_its_gradients_equal_the_same_layer_with_its_experts_at_hand(hosts) -> None:
    """With a layout that waits for every answer (k_min = k, a backward quorum of all calls, long
    timeouts), so that no answer a loaded machine delays past the grace period is left out."""
    torch.manual_seed(0)
    exact = LAYOUT.model_copy(
        update={"k_min": LAYOUT.k, "backward_quorum": 1.0, "forward_timeout": 120.0, "backward_timeout": 120.0}
    )
    client = ExpertClient(exact, hosts["routes"])
    gate, layer = GridGate(LAYOUT.dim, LAYOUT.grid), RemoteExperts(client)
    x = torch.randn(40, LAYOUT.dim, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    target = torch.randn(40, LAYOUT.dim)

    out = layer(0, gate, x)
    expected = reference(gate, x_ref, LAYOUT.uids(0))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    ((out - target) ** 2).sum().backward()
    ((expected - target) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gate.parameters())
    assert layer.dropped_rows == 0
    assert client.figures["forward_failed"] == 0 and client.figures["backward_answered"] > 0
    client.close()


def test_a_dead_hosts_experts_are_dropped_and_the_rest_renormalised(hosts) -> None:
    torch.manual_seed(1)
    gate, layer = GridGate(LAYOUT.dim, LAYOUT.grid), RemoteExperts(hosts["client"])
    x = torch.randn(60, LAYOUT.dim, requires_grad=True)
    hosts["b"].stop(timeout=0)  # SIGTERM, then SIGKILL: its experts stop answering

    out = layer(0, gate, x)
    expected = reference(gate, x.detach(), HOST_A)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    # k = 3 of 6 experts and k_min = 2: a row whose best three include two or three of B's has too few.
    assert 0 < layer.dropped_rows < 60
    assert hosts["client"].figures["forward_failed"] == 3
    out.sum().backward()  # backward goes to the answering experts only, and succeeds
    assert x.grad is not None and np.isfinite(x.grad.numpy()).all()
    assert hosts["client"].figures["backward_failed"] == 0
