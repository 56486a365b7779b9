"""The modules of a mixture-of-experts model (mode `moe`, crowdtrain.core.experts): the dense trunk a
trainer holds and the parameter servers merge, an expert as its host builds it, and the routing that
both a trainer (over remote experts) and the parameter servers' evaluation (over experts at hand)
compute alike. No I/O.

Gating follows Learning@home (Ryabinin & Gusev 2020, section 3.1): a layer's experts sit on a grid,
one small linear layer per grid dimension scores its coordinates, and an expert's score is the sum
of its coordinates' scores, g(x) = sum_i g_i(x)[u_i]. Each input goes to its k best experts among
those available; the answers that came are weighted by a softmax over their scores (the others'
weights renormalised away), and a row with fewer than `k_min` answers gets no output from the layer.
"""

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from crowdtrain.core.experts import EXPERT_PREFIX, ExpertLayout, parse_uid


class FeedForwardExpert(nn.Module):
    """An expert: dim -> hidden -> dim with a GELU between, as the experts of Learning@home's experiments."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def build_expert(layout: ExpertLayout, uid: str, seed: int | None = None) -> FeedForwardExpert:
    """Expert `uid`'s module with its initial weights: the same for every host that builds it from the
    same seed (the layout's by default), so that a host starting an expert that has no checkpoint yet
    starts where any other would, and an evaluation without its checkpoint uses what it started from.
    The global random state is left as it was."""
    layer, coords = parse_uid(uid)
    seed = layout.seed if seed is None else seed
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed * 1_000_003 + layer * 65_537 + int(np.ravel_multi_index(coords, layout.grid)))
        return FeedForwardExpert(layout.dim, layout.hidden)
    finally:
        torch.random.set_rng_state(generator_state)


class GridGate(nn.Module):
    """Scores of a layer's experts: one linear layer per grid dimension, an expert's score the sum of
    its coordinates' scores."""

    def __init__(self, dim: int, grid: list[int]):
        super().__init__()
        self.per_dimension = nn.ModuleList(nn.Linear(dim, n) for n in grid)

    def forward(self, x: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """[rows, experts] scores of the experts at `coords` [experts, grid dimensions]."""
        return torch.stack([gate(x)[:, coords[:, i]] for i, gate in enumerate(self.per_dimension)]).sum(dim=0)


def route(gate: GridGate, x: torch.Tensor, uids: Sequence[str], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores [rows, k'] and indices into `uids` [rows, k'] of each row's k' = min(k, len(uids))
    best experts among `uids` (a non-empty list of one layer's expert ids)."""
    coords = torch.tensor([parse_uid(uid)[1] for uid in uids])
    scores = gate(x, coords)
    top_scores, top = scores.topk(min(k, len(uids)), dim=1)
    return top_scores, top


def combine(
    top_scores: torch.Tensor, y: torch.Tensor, came: torch.Tensor, k_min: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output [rows, dim] from the experts' answers `y` [rows, k, dim] where `came`
    [rows, k]: a softmax over the scores of the answers that came, and zero for the rows with fewer
    than `k_min` (which are marked False in the second tensor returned)."""
    enough = came.sum(dim=1) >= k_min
    # Rows with no answer at all are given finite scores, so that no NaN of a softmax over -inf
    # reaches the gradient; their weights are zeroed with the other rows that have too few.
    some = came.any(dim=1, keepdim=True)
    scores_came = torch.where(some, top_scores.masked_fill(~came, float("-inf")), torch.zeros_like(top_scores))
    weights = torch.where(enough[:, None], torch.softmax(scores_came, dim=1), torch.zeros_like(top_scores))
    return (weights[:, :, None] * y).sum(dim=1), enough


class MixtureLayers(Protocol):
    """What computes a trunk's mixture-of-experts layers: layer `layer`'s output [rows, dim] for its
    normalised input `x`, routed by the trunk's `gate` of that layer."""

    def __call__(self, layer: int, gate: GridGate, x: torch.Tensor) -> torch.Tensor: ...


class MixtureTrunk(nn.Module):
    """The dense part of a mixture-of-experts classifier, which a trainer holds and the parameter
    servers merge like any model: input -> linear to the layout's width -> each mixture layer as a
    residual branch after a layer norm (h + moe(norm(h)), routed by the layer's grid gate) -> layer
    norm -> linear to the classes. Without `experts` every mixture layer adds nothing (how the
    scheduler checks the trunk's shapes); a row a layer drops passes through it unchanged."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, layout: dict[str, Any]):
        super().__init__()
        self.layout = ExpertLayout.model_validate(layout)
        dim = self.layout.dim
        self.embed = nn.Linear(math.prod(input_shape), dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(self.layout.layers))
        self.gates = nn.ModuleList(GridGate(dim, self.layout.grid) for _ in range(self.layout.layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))

    def forward(self, x: torch.Tensor, experts: MixtureLayers | None = None) -> torch.Tensor:
        h = self.embed(torch.flatten(x, 1))
        if experts is not None:
            for layer, (norm, gate) in enumerate(zip(self.norms, self.gates, strict=True)):
                h = h + experts(layer, gate, norm(h))  # type: ignore[arg-type]
        logits: torch.Tensor = self.head(h)
        return logits


class LocalExperts:
    """A trunk's mixture layers computed with every expert at hand (the parameter servers' evaluation):
    each row's k best experts of the whole grid, all answering."""

    def __init__(self, layout: ExpertLayout, experts: dict[str, FeedForwardExpert]):
        self.layout, self.experts = layout, experts

    def __call__(self, layer: int, gate: GridGate, x: torch.Tensor) -> torch.Tensor:
        uids = self.layout.uids(layer)
        top_scores, top = route(gate, x, uids, self.layout.k)
        y = torch.zeros(x.shape[0], top.shape[1], self.layout.dim)
        for e in torch.unique(top).tolist():
            rows, places = (top == e).nonzero(as_tuple=True)
            y[rows, places] = self.experts[uids[e]](x[rows])
        out, _ = combine(top_scores, y, torch.ones_like(top, dtype=torch.bool), self.layout.k_min)
        return out


def local_experts(layout: ExpertLayout, params: dict[str, np.ndarray]) -> LocalExperts:
    """Every expert of `layout`: with the weights `params` holds for it (expert/UID/NAME) when they are
    the expert's every tensor, shaped as its own and finite; else with its initial weights (an expert
    with no checkpoint yet is where its host started it)."""
    modules = {}
    for layer in range(layout.layers):
        for uid in layout.uids(layer):
            module = build_expert(layout, uid)
            prefix = f"{EXPERT_PREFIX}{uid}/"
            mine = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
            if mine and _fits(module, mine):
                module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in mine.items()}, strict=True)
            modules[uid] = module.eval()
    return LocalExperts(layout, modules)


def _fits(module: nn.Module, weights: dict[str, np.ndarray]) -> bool:
    own = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    return {k: tuple(v.shape) for k, v in weights.items()} == own and all(
        np.isfinite(v).all() for v in weights.values()
    )
