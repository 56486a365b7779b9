"""Which framework trains which model: the job's own first, another with a port of the zoo model
next, TensorFlow alone for Keras JSON models."""

import pytest

from crowdtrain.core import frameworks


@pytest.mark.parametrize(
    ("model", "have", "expected"),
    [
        ({"name": "cnn1d", "framework": "tensorflow"}, ["pytorch", "tensorflow"], "tensorflow"),
        ({"name": "cnn1d", "framework": "tensorflow"}, ["pytorch"], "pytorch"),
        ({"name": "cnn1d"}, ["pytorch", "tensorflow"], "pytorch"),  # jobs from before frameworks: PyTorch
        ({"name": "mlp", "framework": "pytorch"}, ["tensorflow"], "tensorflow"),
        ({"name": "resnet", "framework": "pytorch"}, ["tensorflow"], None),  # no Keras port of resnet
        ({"name": "keras", "framework": "tensorflow"}, ["pytorch"], None),
        ({"name": "keras", "framework": "tensorflow"}, ["pytorch", "tensorflow"], "tensorflow"),
    ],
)
def test_pick_prefers_the_jobs_framework_then_any_port(model: dict, have: list[str], expected: str | None) -> None:
    assert frameworks.pick(model, have) == expected
