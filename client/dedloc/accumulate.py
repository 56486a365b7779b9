"""A DeDLOC peer's gradient accumulator: the flattened gradients of its micro-batches, summed, with
the count and indices of the examples they came from. No I/O."""

from dataclasses import dataclass, field

import torch


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients, flattened and concatenated in order (the layout of an Accumulator)."""
    flat = []
    for i, p in enumerate(params):
        if p.grad is None:  # the loss did not reach it: the model has a parameter its forward pass never uses
            raise RuntimeError(f"parameter {i} (shape {tuple(p.shape)}) got no gradient from the loss")
        flat.append(p.grad.reshape(-1))
    return torch.cat(flat)


@dataclass
class Accumulator:
    """Summed gradients of some micro-batches, how many examples they hold and which (their indices)."""

    grads: torch.Tensor
    examples: int = 0
    indices: list[int] = field(default_factory=list)

    def add(self, other: "Accumulator") -> None:
        self.grads += other.grads
        self.examples += other.examples
        self.indices += other.indices
        other.clear()

    def clear(self) -> None:
        self.grads.zero_()
        self.examples = 0
        self.indices = []
