"""Expert-parallel training end to end: a trainer trains a model whose two mixture-of-experts layers
(4x4 grids, top-4) live on three expert host processes, one of which is SIGKILLed mid-run; the
model still reaches its target, which its dense trunk alone does not."""

import signal

import httpx
import numpy as np
import pytest
import torch

from crowdtrain.client.experts.mixture import ExpertClient
from crowdtrain.client.experts.trainer import MixtureClassifier, accuracy, train_step
from crowdtrain.core.experts import ExpertLayout
from tests.client.experts.hosts import start_host

pytestmark = pytest.mark.integration

LAYOUT = ExpertLayout(layers=2, grid=[4, 4], dim=32, hidden=64, k=4, k_min=1, lr=3e-3)
TARGET = 0.9  # a linear trunk reaches about 0.63 on this task, a dense MLP 0.99
KILL_AT, MAX_STEPS, EVAL_EVERY = 60, 800, 25


def clusters(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """40 Gaussian clusters in 8 dimensions, four per class: no linear model separates the classes."""
    centers = np.random.default_rng(12345).normal(size=(40, 8))
    rng = np.random.default_rng(seed)
    which = rng.integers(0, 40, n)
    x = centers[which] + 0.3 * rng.normal(size=(n, 8))
    return x.astype(np.float32), (which % 10).astype(np.int64)


def train(model: MixtureClassifier, steps: int) -> float:
    """`steps` steps of the trainer's loop; the validation accuracy after them."""
    x_train, y_train = clusters(6000, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = rng.integers(0, len(x_train), 64)
        train_step(model, optimizer, x_train[batch], y_train[batch])
    return accuracy(model, *clusters(1000, 2))


def test_the_dense_trunk_alone_stays_below_the_target() -> None:
    """The same model with no expert to call (every mixture layer passes its input on): what the
    experts add is what the test below needs to reach its target."""
    client = ExpertClient(LAYOUT, {})
    torch.manual_seed(0)
    model = MixtureClassifier(8, 10, LAYOUT, client)
    assert train(model, MAX_STEPS) < TARGET - 0.1
    assert model.dropped_rows > 0
    client.close()


def test_a_moe_model_trains_to_its_target_through_expert_hosts_while_one_is_killed(tmp_path) -> None:
    torch.set_num_threads(1)
    x_train, y_train = clusters(6000, 1)
    x_val, y_val = clusters(1000, 2)
    uids = [uid for layer in range(LAYOUT.layers) for uid in LAYOUT.uids(layer)]
    shares = [uids[i::3] for i in range(3)]
    hosts = [start_host(tmp_path, f"host{i}", LAYOUT, share) for i, share in enumerate(shares)]
    client = ExpertClient(LAYOUT, {uid: url for (_, url), share in zip(hosts, shares, strict=True) for uid in share})
    try:
        torch.manual_seed(0)
        model = MixtureClassifier(8, 10, LAYOUT, client)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        rng = np.random.default_rng(0)
        reached, history = None, []
        for step in range(1, MAX_STEPS + 1):
            batch = rng.integers(0, len(x_train), 64)
            train_step(model, optimizer, x_train[batch], y_train[batch])
            if step == KILL_AT:
                failed_before = client.figures["forward_failed"]
                hosts[2][0].signal(signal.SIGKILL)
                hosts[2][0].proc.wait(30)
            if step % EVAL_EVERY == 0:
                history.append((step, accuracy(model, x_val, y_val)))
                if step > KILL_AT and history[-1][1] >= TARGET:
                    reached = step
                    break
        assert reached is not None, history
        # The killed host's experts failed from then on, and only theirs: the others answered every call.
        assert failed_before == 0 and client.figures["forward_failed"] > 0
        for service, url in hosts[:2]:
            figures = httpx.get(f"{url}/v1/experts", timeout=10).json()["experts"]
            assert all(f["failures"] == 0 for f in figures.values()), (service.name, figures)
            assert sum(f["steps"] > 0 for f in figures.values()) >= len(figures) // 2, (service.name, figures)
    finally:
        client.close()
        for service, _ in hosts:
            service.stop()
