"""Local training, one module per framework, behind one call.

`train()` picks the trainer for `framework` ("pytorch" or "tensorflow"). Every trainer takes and
returns named numpy arrays in the job's canonical layout (the zoo's PyTorch `state_dict` names and
shapes for zoo models), so parameter servers never see which framework trained a result.

The contract every trainer keeps:
- it checks `cancel` between batches and raises `Cancelled` when it is set;
- with a `checkpoint`, it calls `checkpoint.due()` between batches and, when it is true,
  `checkpoint.save(tensors, progress)` with everything needed to continue (model and optimizer
  state as named arrays, the position in the data as JSON-able values); when
  `checkpoint.resumed` is not None it starts from that state instead of from `params`.
"""

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crowdtrain.tensors import Params

FRAMEWORKS = ("pytorch", "tensorflow")


class Cancelled(Exception):
    """Training stopped early because the assignment was abandoned or is no longer wanted."""


@dataclass(frozen=True)
class TrainResult:
    params: Params
    train_loss: float
    examples: int
    seconds: float


class Checkpoint(Protocol):
    resumed: tuple[Params, dict] | None

    def due(self) -> bool: ...

    def save(self, tensors: Params, progress: dict) -> None: ...


def available_frameworks() -> list[str]:
    """The frameworks importable in this environment, PyTorch first."""
    import importlib.util

    found = [f for f, module in (("pytorch", "torch"), ("tensorflow", "tensorflow"))
             if importlib.util.find_spec(module) is not None]
    return found


def train(framework: str, recipe: dict, params: Params, x: np.ndarray, y: np.ndarray, device: str = "cpu",
          cancel: threading.Event | None = None, checkpoint: Checkpoint | None = None) -> TrainResult:
    """Train with `framework` from `params` on (x, y); see the module docstring for the contract."""
    if framework == "pytorch":
        from client.trainers.pytorch import train as run
    elif framework == "tensorflow":
        from client.trainers.tensorflow import train as run
    else:
        raise ValueError(f"unknown framework {framework!r}; expected one of {FRAMEWORKS}")
    return run(recipe, params, x, y, device=device, cancel=cancel, checkpoint=checkpoint)
