"""W_s values and rule specs that the parameter store's tests share."""

import numpy as np

NESTEROV = {"rule": "delta", "outer_optimizer": "nesterov", "server_lr": 0.5, "outer_momentum": 0.9}
STEP = {"w": np.full(1000, 0.01, np.float32)}  # every result's update Δ in these tests


def filled(value: float) -> dict[str, np.ndarray]:
    """A small W_s: 1000 float32 weights of `value`, and an integer counter."""
    return {"w": np.full(1000, value, np.float32), "steps": np.array(0, np.int64)}


def assert_same(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(actual[k], v, rtol=1e-6)
