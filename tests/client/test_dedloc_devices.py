"""A DeDLOC peer on a GPU: it computes its gradients there, and after each step it holds the very
parameters (digest) a CPU peer holds, so the scheduler accepts its state like theirs. The GPU cases
run where torch sees CUDA and are skipped elsewhere; the CPU cases hold the same peer to the same
contract everywhere."""

import numpy as np
import pytest
import torch

from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.client.dedloc.peer import DedlocPeer, PeerOptions
from crowdtrain.client.dedloc.state import encode_state
from crowdtrain.core import dedloc
from crowdtrain.core.tensors import decode
from crowdtrain.core.zoo import state_to_numpy
from tests.client.gpu import DEVICES

MODELS = {
    "mlp": {"name": "mlp", "input_shape": [12], "num_classes": 4, "options": {"seed": 3, "hidden": [32]}},
    # BatchNorm's running statistics are buffers the forward passes update on the device.
    "resnet": {"name": "resnet", "input_shape": [3, 32, 32], "num_classes": 4, "options": {"seed": 3, "width": 4}},
}


def _recipe(model: str, optimizer: str) -> dict:
    dedloc_spec = {
        "target_batch_size": 16,
        "micro_batch_size": 8,
        "optimizer": optimizer,
        "lr": 0.05,
        "momentum": 0.9,
        "weight_decay": 1e-4,
        "lr_schedule": "constant",
        "warmup_steps": 0,
    }
    return {"model": MODELS[model], "dedloc": dedloc_spec, "seed": 5, "max_steps": 100}


def _examples(model: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = MODELS[model]["input_shape"]
    return rng.standard_normal((64, *shape)).astype(np.float32), (np.arange(64) % 4).astype(np.int64)


def _peer(model: str, optimizer: str, device: str) -> DedlocPeer:
    """A peer set up as `join` sets it up, without a scheduler (nothing here sends a request)."""
    peer = DedlocPeer(PeerAPI("http://127.0.0.1:9"), PeerOptions(job_id=1, device=device))
    peer.set_up(_recipe(model, optimizer), *_examples(model))
    peer.step = 0
    return peer


def _commit(peers: list[DedlocPeer]) -> torch.Tensor:
    """One step: each peer computes a micro-batch and reports it; every peer applies the average of
    what they reported, as a committed round hands it to each (a CPU vector)."""
    for peer in peers:
        peer.compute_micro_batch(8)
        peer.reported.add(peer.fresh)
    total = sum(peer.reported.examples for peer in peers)
    average = sum(peer.reported.grads.cpu() for peer in peers) / total
    for peer in peers:
        peer.reduced = (peer.step, 0, average.clone())
        peer.apply()
    return average


@pytest.mark.parametrize("device", DEVICES)
def test_a_peer_computes_on_its_device_the_gradient_a_cpu_peer_computes(device: str) -> None:
    on_cpu, on_device = _peer("mlp", "sgd", "cpu"), _peer("mlp", "sgd", device)
    on_cpu.compute_micro_batch(8)
    on_device.compute_micro_batch(8)
    assert on_device.fresh.grads.device == torch.device(device)
    assert on_device.fresh.indices == on_cpu.fresh.indices and on_device.fresh.examples == 8
    assert float(on_cpu.fresh.grads.abs().sum()) > 0
    torch.testing.assert_close(on_device.fresh.grads.cpu(), on_cpu.fresh.grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_peers_on_a_gpu_and_a_cpu_hold_the_same_parameters_after_each_step(
    device: str, model: str, optimizer: str
) -> None:
    on_cpu, on_device = _peer(model, optimizer, "cpu"), _peer(model, optimizer, device)
    start = on_cpu.params_digest()
    assert on_device.params_digest() == start, "both start from the recipe's model"
    for step in range(3):
        _commit([on_cpu, on_device])
        assert on_cpu.step == on_device.step == step + 1
        params = [k for k, v in on_cpu.model.named_parameters()]
        digest = dedloc.digest({k: v for k, v in state_to_numpy(on_cpu.model).items() if k in params})
        assert dedloc.digest({k: v for k, v in state_to_numpy(on_device.model).items() if k in params}) == digest
    assert on_cpu.params_digest() != start, "the steps moved the parameters"
    if model == "mlp":  # no buffers: the whole digest a peer reports agrees
        assert on_device.params_digest() == on_cpu.params_digest()
    # The copy on the device computes the next gradient at the parameters just agreed on.
    on_device.compute_micro_batch(8)
    torch.testing.assert_close(
        [p.detach().cpu() for p in on_device.compute.params], [p.detach() for p in on_cpu.model.parameters()]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_a_gpu_peers_state_holds_the_running_statistics_its_forward_passes_updated(device: str) -> None:
    peer = _peer("resnet", "sgd", device)
    before = {k: v.copy() for k, v in state_to_numpy(peer.model).items() if "running_mean" in k}
    peer.compute_micro_batch(8)
    peer.params_digest()  # as a report does before an upload: the buffers come back from the device
    state = decode(encode_state(peer.model, peer.opt))
    moved = [k for k in before if not np.array_equal(state[k], before[k])]
    assert moved, "the state holds the running statistics of the micro-batch"
    buffers = dict(peer.compute.model.named_buffers())
    for k in moved:
        np.testing.assert_array_equal(state[k], buffers[k].cpu().numpy())
