"""The dense trunk of a mixture-of-experts model trained alone: the baseline that tests of expert-parallel
training compare against, so that reaching their target shows what the experts add."""

from collections.abc import Sequence

import numpy as np
import torch

from crowdtrain.client.experts.mixture import ExpertClient
from crowdtrain.client.experts.trainer import MixtureClassifier, accuracy, train_step
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.zoo_experts import MixtureTrunk

Split = tuple[np.ndarray, np.ndarray]


def trunk_alone(
    layout: ExpertLayout,
    input_shape: Sequence[int],
    classes: int,
    train: Split,
    val: Split,
    steps: int,
    batch: int,
    lr: float,
) -> tuple[float, int]:
    """The model of `layout` with no expert to call (each mixture layer passes its input on), trained
    `steps` steps of Adam at `lr` on random batches of `train` (seed 0): its accuracy on `val`, and the
    rows its mixture layers dropped (every one, with no expert)."""
    client = ExpertClient(layout, {})
    try:
        torch.manual_seed(0)
        model = MixtureClassifier(MixtureTrunk(list(input_shape), classes, layout.model_dump()), client)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        rng = np.random.default_rng(0)
        x, y = train
        for _ in range(steps):
            i = rng.integers(0, len(x), batch)
            train_step(model, optimizer, x[i], y[i])
        return accuracy(model, *val), model.dropped_rows
    finally:
        client.close()
