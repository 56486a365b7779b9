"""The TensorFlow trainer: it learns, keeps the canonical layout, answers a cancel between batches,
and a run resumed from a mid-run checkpoint ends where an uninterrupted run ends."""

import threading

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from crowdtrain.client.journal import FileCheckpoint  # noqa: E402
from crowdtrain.client.trainers import Cancelled, TrainControl, train  # noqa: E402
from crowdtrain.core.zoo import build_model, state_to_numpy  # noqa: E402

CNN = {
    "name": "cnn1d",
    "framework": "tensorflow",
    "input_shape": [40],
    "num_classes": 10,
    "options": {"channels": 8, "kernel_size": 5, "layers": 2},
}


def recipe(optimizer: str = "adam", local_epochs: int = 2, weight_decay: float = 0.0) -> dict:
    return {
        "model": CNN,
        "seed": 7,
        "training": {
            "local_epochs": local_epochs,
            "batch_size": 16,
            "optimizer": optimizer,
            "lr": 0.01 if optimizer == "adam" else 0.05,
            "momentum": 0.9,
            "weight_decay": weight_decay,
        },
    }


@pytest.fixture(scope="module")
def shard() -> tuple[np.ndarray, np.ndarray]:
    # Separable data: the class is the index of the largest of 10 position-bins.
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, 200)
    x = rng.normal(0, 0.3, (200, 40)).astype(np.float32)
    x[np.arange(200), y * 4 + 2] += 3.0
    return x, y


@pytest.fixture(scope="module")
def initial() -> dict[str, np.ndarray]:
    return state_to_numpy(build_model("cnn1d", [40], 10, seed=3, **CNN["options"]))


class MemoryCheckpoint:
    """A Checkpoint that saves once, at the `at`-th due() call, and keeps the save in memory."""

    def __init__(self, at: int | None = None, resumed=None):
        self.at, self.calls, self.saved, self.resumed = at, 0, None, resumed

    def due(self) -> bool:
        self.calls += 1
        return self.calls == self.at

    def save(self, tensors, progress) -> None:
        self.saved = ({k: np.array(v, copy=True) for k, v in tensors.items()}, dict(progress))


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_training_lowers_the_loss_and_keeps_the_canonical_layout(shard, initial, optimizer: str) -> None:
    x, y = shard
    first = train("tensorflow", recipe(optimizer, local_epochs=1), initial, x, y)
    more = train("tensorflow", recipe(optimizer, local_epochs=8, weight_decay=1e-4), initial, x, y)
    assert more.train_loss < 0.8 * first.train_loss
    assert {k: (v.shape, v.dtype) for k, v in more.params.items()} == {
        k: (v.shape, v.dtype) for k, v in initial.items()
    }
    assert more.examples == 8 * len(x)


def test_cancel_stops_training_between_batches(shard, initial) -> None:
    x, y = shard
    control = TrainControl()
    control.cancel()
    with pytest.raises(Cancelled):
        train("tensorflow", recipe(), initial, x, y, control=control)


def test_pause_holds_training_until_resumed(shard, initial) -> None:
    x, y = shard
    control = TrainControl()
    control.pause()
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (train("tensorflow", recipe(), initial, x, y, control=control), done.set())
    )
    worker.start()
    assert not done.wait(3.0), "training ran while paused"
    control.resume()
    worker.join(60)
    assert done.is_set()


def test_resume_from_a_mid_run_checkpoint_ends_like_an_uninterrupted_run(shard, initial, tmp_path) -> None:
    x, y = shard
    whole = train("tensorflow", recipe(), initial, x, y)
    # 13 batches per epoch, no save before a run's first batch: the 17th due() comes before
    # epoch 2's 5th batch (index 4), with Adam's moments well under way.
    first = MemoryCheckpoint(at=17)
    control = TrainControl()
    original_save = first.save

    def save_then_stop(tensors, progress):  # the client is preempted right after the checkpoint
        original_save(tensors, progress)
        control.cancel()

    first.save = save_then_stop
    with pytest.raises(Cancelled):
        train("tensorflow", recipe(), initial, x, y, control=control, checkpoint=first)
    assert first.saved[1]["epoch"] == 1 and first.saved[1]["batch"] == 4 * 16
    # Through the client's checkpoint file (safetensors + JSON progress), as after a restart.
    FileCheckpoint(tmp_path / "a.ckpt", 30).save(*first.saved)
    resumed = train("tensorflow", recipe(), {}, x, y, checkpoint=FileCheckpoint(tmp_path / "a.ckpt", 30))
    # Same batches in the same order from the same state: on one machine's CPU kernels, bit for bit.
    for name, value in whole.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    assert resumed.train_loss == whole.train_loss


def test_limit_threads_before_tensorflow_starts_does_not_import_it() -> None:
    import subprocess
    import sys

    code = (
        "import sys, os; from crowdtrain.client.trainers.tensorflow import limit_threads; limit_threads(3); "
        "print('tensorflow' in sys.modules, os.environ['TF_NUM_INTRAOP_THREADS'], "
        "os.environ['TF_NUM_INTEROP_THREADS'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "3", "3"]
