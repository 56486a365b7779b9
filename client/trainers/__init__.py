"""Local training, one module per framework, behind one call.

`train()` picks the trainer for `framework` ("pytorch" or "tensorflow"). Every trainer takes and
returns named numpy arrays in the job's canonical layout (the zoo's PyTorch `state_dict` names and
shapes for zoo models), so parameter servers never see which framework trained a result.

The contract every trainer keeps:
- it calls `control.between_batches()` between batches: that raises `Cancelled` once the
  assignment is cancelled and blocks while the client is paused (the machine is not idle);
- it trains `local_steps(...)` batches: the recipe's `local_epochs` passes over the shard, cut to
  `local_fraction` of their steps (dynamic local work), and reports the examples it trained;
- with a `checkpoint`, it calls `checkpoint.due()` between batches and, when it is true,
  `checkpoint.save(tensors, progress)` with everything needed to continue (model and optimizer
  state as named arrays, the position in the data as JSON-able values); when
  `checkpoint.resumed` is not None it starts from that state instead of from `params`;
- a trainer in `KEEPS_OPTIMIZER_STATE` starts its optimizer from `optimizer_state` (an earlier
  result's, same model and training settings) when given and not resuming, and returns its state at
  the end in `TrainResult.optimizer_state`; the others ignore `optimizer_state` and return None.
"""

import importlib
import math
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crowdtrain.core.frameworks import FRAMEWORKS, Framework, installed
from crowdtrain.core.schemas_experts import CallReport, CallsRecorded, RoutingTable
from crowdtrain.core.tensors import Params

# The trainer module of each framework, imported only when it trains: each imports its framework.
TRAINERS = {"pytorch": "crowdtrain.client.trainers.pytorch", "tensorflow": "crowdtrain.client.trainers.tensorflow"}
# The trainer of a mode moe workunit (the trunk of model "moe", through its remote experts): PyTorch.
MOE_MODEL, MOE_TRAINER = "moe", "crowdtrain.client.experts.workunit"
# The trainers that can start from an optimizer state (the Keras one always starts from zero).
KEEPS_OPTIMIZER_STATE = frozenset({"pytorch"})


class ExpertRegistry(Protocol):
    """The scheduler's calls a mode moe workunit makes (crowdtrain.client.api.SchedulerAPI has them):
    the routing table's changes since a version, and the report of its calls to the experts."""

    def routing(self, mixture_id: int, since: int) -> RoutingTable: ...

    def report_calls(self, mixture_id: int, report: CallReport) -> CallsRecorded: ...


class Cancelled(Exception):
    """Training stopped early because the assignment was abandoned or is no longer wanted."""


@dataclass(frozen=True)
class TrainResult:
    params: Params
    train_loss: float
    examples: int
    seconds: float
    # The optimizer's state at the end (Adam moments and step, SGD momentum) as named arrays, from
    # trainers that can start from one (`optimizer_state`); None from the others.
    optimizer_state: Params | None = None


def local_steps(examples: int, batch_size: int, local_epochs: int, local_fraction: float = 1.0) -> int:
    """Batches to train: `local_fraction` of `local_epochs` passes over `examples` in batches of
    `batch_size`, rounded up, and at least one."""
    if not 0 < local_fraction <= 1:
        raise ValueError(f"local_fraction must lie in (0, 1], got {local_fraction}")
    per_epoch = math.ceil(examples / batch_size)
    return max(1, math.ceil(per_epoch * local_epochs * local_fraction - 1e-9))


def examples_in(steps: int, examples: int, batch_size: int) -> int:
    """Examples in the first `steps` batches of passes over `examples` (each pass ends in a short batch)."""
    per_epoch = math.ceil(examples / batch_size)
    full, rest = divmod(steps, per_epoch)
    return full * examples + min(rest * batch_size, examples)


class TrainControl:
    """How the client steers a running trainer: cancel it, or pause it between batches."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self._running = threading.Event()
        self._running.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def between_batches(self) -> None:
        """Raise Cancelled if cancelled; while paused, wait (still answering a cancel)."""
        while not self._running.wait(0.2):
            if self.cancelled.is_set():
                raise Cancelled()
        if self.cancelled.is_set():
            raise Cancelled()


class Checkpoint(Protocol):
    resumed: tuple[Params, dict] | None

    def due(self) -> bool: ...

    def save(self, tensors: Params, progress: dict) -> None: ...


def available_frameworks() -> list[Framework]:
    """The frameworks importable in this environment, PyTorch first."""
    return installed()


def limit_threads(n: int, frameworks: Collection[str] | None = None) -> None:
    """Cap the CPU threads `frameworks` (default: every installed one) use for training (call before training)."""
    frameworks = available_frameworks() if frameworks is None else frameworks
    if "pytorch" in frameworks:
        import torch

        torch.set_num_threads(n)
    if "tensorflow" in frameworks:
        importlib.import_module(TRAINERS["tensorflow"]).limit_threads(n)


def train(
    framework: str,
    recipe: dict,
    params: Params,
    x: np.ndarray,
    y: np.ndarray,
    device: str = "cpu",
    control: TrainControl | None = None,
    checkpoint: Checkpoint | None = None,
    local_fraction: float = 1.0,
    optimizer_state: Params | None = None,
    experts: ExpertRegistry | None = None,
) -> TrainResult:
    """Train with `framework` from `params` on (x, y) for `local_fraction` of the recipe's local
    epochs' steps, the optimizer from `optimizer_state` where the trainer can; see the module
    docstring for the contract. The trunk of a mixture-of-experts model (mode moe) trains through its
    experts, found and reported on through `experts` (crowdtrain.client.experts.workunit)."""
    if framework not in TRAINERS:
        raise ValueError(f"unknown framework {framework!r}; expected one of {FRAMEWORKS}")
    if recipe["model"]["name"] == MOE_MODEL:
        if experts is None:
            raise ValueError("a moe workunit trains through its mixture's experts: give the expert registry")
        run_moe = importlib.import_module(MOE_TRAINER).train
        result: TrainResult = run_moe(
            recipe, params, x, y, experts, control, local_fraction=local_fraction, optimizer_state=optimizer_state
        )
        return result
    run = importlib.import_module(TRAINERS[framework]).train
    extra = {"optimizer_state": optimizer_state} if framework in KEEPS_OPTIMIZER_STATE else {}
    return run(
        recipe,
        params,
        x,
        y,
        device=device,
        control=control or TrainControl(),
        checkpoint=checkpoint,
        local_fraction=local_fraction,
        **extra,
    )
