"""The parameter server evaluates W_s with the job's framework; both frameworks score the same
canonical weights alike."""

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from crowdtrain.assimilator.evaluate import evaluate, evaluation_framework  # noqa: E402
from crowdtrain.core.zoo import build_model, state_to_numpy  # noqa: E402

OPTIONS = {"channels": 32, "kernel_size": 5, "layers": 3}
CONFIG = {"name": "cnn1d", "framework": "tensorflow", "input_shape": [40], "num_classes": 10, "options": OPTIONS}


@pytest.fixture(scope="module")
def data():
    from crowdtrain.workgen.datasets import load_dataset

    return load_dataset("builtin:mnist1d")


def canonical_weights(data, trained: bool) -> dict[str, np.ndarray]:
    params = state_to_numpy(build_model("cnn1d", [40], 10, seed=0, **OPTIONS))
    if trained:  # weights that classify well, so that accuracy is a real test of agreement
        from crowdtrain.client.trainers import train

        recipe = {
            "model": CONFIG,
            "seed": 0,
            "training": {
                "local_epochs": 2,
                "batch_size": 32,
                "optimizer": "adam",
                "lr": 0.01,
                "momentum": 0.0,
                "weight_decay": 0.0,
            },
        }
        params = train("pytorch", recipe, params, data.x[:2000], data.y[:2000]).params
    return params


def test_the_jobs_framework_evaluates_when_installed() -> None:
    assert evaluation_framework({"name": "cnn1d", "framework": "tensorflow"}) == "tensorflow"
    assert evaluation_framework({"name": "cnn1d", "framework": "pytorch"}) == "pytorch"
    assert evaluation_framework({"name": "resnet"}) == "pytorch"
    assert evaluation_framework({"name": "keras", "framework": "tensorflow"}) == "tensorflow"


@pytest.mark.parametrize("trained", [False, True])
def test_tensorflow_and_pytorch_evaluate_the_same_cnn1d_weights_alike(data, trained: bool) -> None:
    params = canonical_weights(data, trained)
    tf_loss, tf_acc = evaluate(100 + trained, CONFIG, params, data.x_val, data.y_val, framework="tensorflow")
    torch_loss, torch_acc = evaluate(200 + trained, CONFIG, params, data.x_val, data.y_val, framework="pytorch")
    assert tf_loss == pytest.approx(torch_loss, rel=1e-5)
    assert abs(tf_acc - torch_acc) <= 1 / len(data.y_val)  # at most one near-tie argmax may differ
    if trained:
        assert tf_acc > 0.5
