"""A trainer's model and steps: a dense trunk around the remote mixture-of-experts layers
(crowdtrain.client.experts.mixture). The trunk's parameters live here; the experts' live on their
hosts, which step them on each backward call."""

import numpy as np
import torch
from torch import nn

from crowdtrain.client.experts.mixture import ExpertClient, RemoteMixture
from crowdtrain.core.experts import ExpertLayout


class MixtureClassifier(nn.Module):
    """input -> linear to the layout's width -> each mixture layer as a residual branch after a layer
    norm (x + moe(norm(x))) -> layer norm -> linear to the classes. A row that a layer drops (too few
    experts answered) passes through that layer unchanged."""

    def __init__(self, input_dim: int, num_classes: int, layout: ExpertLayout, client: ExpertClient):
        super().__init__()
        self.embed = nn.Linear(input_dim, layout.dim)
        self.norms = nn.ModuleList(nn.LayerNorm(layout.dim) for _ in range(layout.layers))
        self.mixtures = nn.ModuleList(RemoteMixture(layout, layer, client) for layer in range(layout.layers))
        self.head = nn.Sequential(nn.LayerNorm(layout.dim), nn.Linear(layout.dim, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for norm, mixture in zip(self.norms, self.mixtures, strict=True):
            h = h + mixture(norm(h))
        logits: torch.Tensor = self.head(h)
        return logits

    @property
    def dropped_rows(self) -> int:
        return sum(m.dropped_rows for m in self.mixtures)  # type: ignore[misc]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: np.ndarray, y: np.ndarray) -> float:
    """One step on the batch (x, y): the trunk's by `optimizer`, the experts' on their hosts. Its loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 512) -> float:
    with torch.no_grad():
        right = sum(
            int((model(torch.from_numpy(x[i : i + batch])).argmax(1).numpy() == y[i : i + batch]).sum())
            for i in range(0, len(x), batch)
        )
    return right / len(x)
