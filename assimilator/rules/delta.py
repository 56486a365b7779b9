"""Rules that apply updates Δ = W_c − W_base to the current W_s instead of mixing weights. No I/O.

`Delta` is FedAsync (Xie et al. 2019): each update, weighted by its staleness s(τ), is one step of an
outer optimizer (by default W_s <- W_s + η·s(τ)·Δ). `FedBuff` (Nguyen et al. 2022, "Federated
Learning with Buffered Asynchronous Aggregation") keeps K weighted updates in its state and steps
once every K with their combination (mean, or a robust combiner). Both see only the floating-point
tensors: integer tensors keep the server's value.
"""

from dataclasses import dataclass

import numpy as np

from crowdtrain.assimilator.rules.combiners import combine
from crowdtrain.assimilator.rules.outer import OuterOptimizer
from crowdtrain.assimilator.rules.staleness import StalenessWeight
from crowdtrain.assimilator.rules.update import Scaled, Update
from crowdtrain.core.tensors import Params

BUFFERED = "buffer.count"  # FedBuff: how many slots of the buffer hold an update (0-d int64)


@dataclass(frozen=True)
class Delta:
    """W_s moves by the outer optimizer's step on s(τ)·Δ, one update at a time."""

    weight: StalenessWeight
    outer: OuterOptimizer

    def initial_state(self, server: Params) -> Params:
        return self.outer.initial_state(server)

    def apply(self, server: Params, state: Params, update: Update) -> None:
        self.outer.step(server, state, Scaled(update.delta, self.weight(update.staleness)))


def _slot(index: int, name: str) -> str:
    return f"buffer.{index}.{name}"


@dataclass(frozen=True)
class FedBuff:
    """Buffers `size` weighted updates in its state (`buffer.<i>.<name>`, `buffer.count`); the update
    that fills the buffer combines them and makes one outer step. With size 1 this is `Delta`.

    The buffer holds every update, not a running sum, because the median and the trimmed mean need
    them all; it costs `size` copies of the model's floating-point tensors in Redis.
    """

    weight: StalenessWeight
    outer: OuterOptimizer
    size: int
    combiner: str = "mean"
    trim_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {self.size}")

    def initial_state(self, server: Params) -> Params:
        slots = {
            _slot(i, name): np.zeros_like(w)
            for i in range(self.size)
            for name, w in server.items()
            if w.dtype.kind == "f"
        }
        return slots | {BUFFERED: np.zeros((), np.int64)} | self.outer.initial_state(server)

    def apply(self, server: Params, state: Params, update: Update) -> None:
        filled = int(state[BUFFERED])
        for name, d in Scaled(update.delta, self.weight(update.staleness)).items():
            state[_slot(filled, name)][...] = d
        filled += 1
        if filled < self.size:
            state[BUFFERED][...] = filled
            return
        combined = {
            name: combine(self.combiner, [state[_slot(i, name)] for i in range(self.size)], self.trim_fraction)
            for name in update.delta
        }
        self.outer.step(server, state, combined)
        state[BUFFERED][...] = 0
