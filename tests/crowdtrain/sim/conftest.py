"""What the simulator's tests share: a tiny dataset, a job spec over it, and service-time settings."""

import numpy as np
import pytest

from crowdtrain.sim.result import SimResult
from crowdtrain.sim.training import simulate_training
from crowdtrain.workgen.datasets import Dataset, make_dataset

# Parameter servers that merge and evaluate in no time: tests of the hosts' side, where the servers'
# queue (tests/crowdtrain/sim/test_servers.py) would only blur the figures.
INSTANT = {"merge_seconds": 0.0, "eval_seconds": 0.0, "pass_seconds": 0.0}
# The VC-ASGD paper's model: each slot holds one assignment at a time, merges are instant, and a slot
# with nothing to do is given work the moment some is ready (no client told to ask again later).
PAPER = {"prefetch": False, "retry_after": 0.0, **INSTANT}


@pytest.fixture(scope="session")
def blobs() -> Dataset:
    """Four separable Gaussian blobs in 8 dimensions: 640 training and 160 validation examples."""
    rng = np.random.default_rng(0)
    centers = rng.normal(scale=3.0, size=(4, 8))
    y = rng.integers(0, 4, 800)
    x = centers[y] + rng.normal(size=(800, 8))
    return make_dataset(x, y, None, None, validation_fraction=0.2)


def job(subsets: int, max_epochs: int, **sections) -> dict:
    spec = {
        "name": "blobs",
        "model": {"name": "mlp", "options": {"hidden": [16]}},
        "dataset": {"source": "builtin:mnist1d", "subsets": subsets},  # the data is passed in instead
        "training": {"local_epochs": 1, "batch_size": 32, "optimizer": "adam", "lr": 0.01},
        "stop": {"target_accuracy": 0.999, "max_epochs": max_epochs},
        "scheduling": {"max_errors": 1000},
    }
    for name, values in sections.items():
        spec[name] = {**spec.get(name, {}), **values}
    return spec


def timed(spec: dict, data: Dataset, **options) -> SimResult:
    """A compute-free run for timing: hosts of identical speed, workunits of 1 s, parameter servers
    that take no time; `options` (simulate_training's) override any of these."""
    settings = {"speed_sigma": 0.0, "workunit_seconds": 1.0, **INSTANT, **options}
    return simulate_training(spec, compute=False, data=data, **settings)
