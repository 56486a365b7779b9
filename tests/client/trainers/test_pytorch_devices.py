"""The PyTorch trainer on the volunteer's device: a GPU trains the workunit a CPU would (the same
steps, the same examples, parameters within float error), returns CPU arrays, checkpoints mid-run
and resumes, and hands an optimizer state on that the next workunit takes on any device. The GPU
cases run where torch sees CUDA and are skipped elsewhere."""

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from crowdtrain.client.trainers import TrainResult, train
from crowdtrain.core.tensors import Params
from crowdtrain.core.zoo import build_model, state_to_numpy
from tests.client.gpu import DEVICES

MODELS = {
    "cnn1d": {"name": "cnn1d", "input_shape": [40], "num_classes": 5, "options": {"channels": 8}},
    "resnet": {"name": "resnet", "input_shape": [3, 32, 32], "num_classes": 5, "options": {"width": 4}},
}


def _recipe(model: str, optimizer: str) -> dict:
    training = {"optimizer": optimizer, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
    return {"model": MODELS[model], "training": training | {"batch_size": 16, "local_epochs": 2}, "seed": 7}


def _workunit(model: str) -> tuple[Params, np.ndarray, np.ndarray]:
    m = MODELS[model]
    params = state_to_numpy(build_model(m["name"], m["input_shape"], m["num_classes"], seed=1, **m["options"]))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((72, *m["input_shape"])).astype(np.float32)
    return params, x, (np.arange(72) % 5).astype(np.int64)


@dataclass
class SaveOnce:
    """A checkpoint due once, after `after` batches; keeps what the trainer saved."""

    after: int
    resumed: tuple[Params, dict] | None = None
    saved: list[tuple[Params, dict]] = field(default_factory=list)
    batches: int = 0

    def due(self) -> bool:
        self.batches += 1
        return not self.saved and self.batches > self.after

    def save(self, tensors: Params, progress: dict) -> None:
        self.saved.append((tensors, progress))


@pytest.fixture
def float32_convolutions():
    """cuDNN convolutions in float32: by default they may round their inputs to TF32 (10-bit
    mantissas), which Adam's per-element normalisation turns into steps of either sign where a
    gradient is near zero; this compares the trainer's work, not the GPU's number format."""
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = allowed


def _assert_close(a: TrainResult, b: TrainResult, rtol: float) -> None:
    assert a.examples == b.examples
    assert a.params.keys() == b.params.keys()
    for k in a.params:
        assert isinstance(a.params[k], np.ndarray) and a.params[k].dtype == b.params[k].dtype, k
        np.testing.assert_allclose(a.params[k], b.params[k], rtol=rtol, atol=rtol, err_msg=k)
    assert a.train_loss == pytest.approx(b.train_loss, rel=rtol)


# Adam on the batch-normalised resnet is left out: its per-element normalisation turns the float
# error between two devices' gradients into steps of either sign, which the network's scale
# invariance keeps (an H200 against its CPU: 0.03-0.07 apart after 10 steps that moved 0.1, with
# TF32 off; SGD on the same network agrees within 2e-3).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("model", "optimizer"), [("cnn1d", "sgd"), ("cnn1d", "adam"), ("resnet", "sgd")])
def test_a_workunit_trained_on_the_device_matches_the_cpu(
    device: str, model: str, optimizer: str, float32_convolutions: None
) -> None:
    params, x, y = _workunit(model)
    recipe = _recipe(model, optimizer)
    on_cpu = train("pytorch", recipe, params, x, y, device="cpu")
    on_device = train("pytorch", recipe, params, x, y, device=device)
    assert on_cpu.examples == 2 * 72
    assert any(not np.array_equal(on_cpu.params[k], params[k]) for k in params), "training moved the model"
    _assert_close(on_device, on_cpu, rtol=2e-3)
    assert on_device.optimizer_state is not None
    assert all(isinstance(v, np.ndarray) for v in on_device.optimizer_state.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_checkpoint_saved_on_the_device_resumes_there_to_the_uninterrupted_result(
    device: str, optimizer: str
) -> None:
    params, x, y = _workunit("cnn1d")
    recipe = _recipe("cnn1d", optimizer)
    whole = train("pytorch", recipe, params, x, y, device=device)
    checkpoint = SaveOnce(after=4)
    train("pytorch", recipe, params, x, y, device=device, checkpoint=checkpoint)
    [(tensors, progress)] = checkpoint.saved
    assert all(isinstance(v, np.ndarray) for v in tensors.values())
    resumed = train("pytorch", recipe, params, x, y, device=device, checkpoint=SaveOnce(10**6, (tensors, progress)))
    _assert_close(resumed, whole, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_an_optimizer_state_from_the_device_carries_on_to_the_next_workunit_on_the_cpu(device: str) -> None:
    params, x, y = _workunit("cnn1d")
    recipe = _recipe("cnn1d", "adam")
    first_cpu = train("pytorch", recipe, params, x, y, device="cpu")
    first_device = train("pytorch", recipe, params, x, y, device=device)
    assert first_device.optimizer_state is not None and first_cpu.optimizer_state is not None
    nxt = dict(recipe, seed=8)
    carried = train("pytorch", nxt, first_cpu.params, x, y, device="cpu", optimizer_state=first_device.optimizer_state)
    reference = train("pytorch", nxt, first_cpu.params, x, y, device="cpu", optimizer_state=first_cpu.optimizer_state)
    fresh = train("pytorch", nxt, first_cpu.params, x, y, device="cpu")
    _assert_close(carried, reference, rtol=2e-3)
    moved = max(float(np.abs(fresh.params[k] - reference.params[k]).max()) for k in reference.params)
    assert moved > 1e-3, "the carried state changes the training: a fresh optimizer would not match"
