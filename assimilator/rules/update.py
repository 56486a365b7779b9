"""What every merge rule sees and promises: one `Update` at a time, W_s and the rule's state in place."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crowdtrain.core.tensors import Params


@dataclass(frozen=True)
class Update:
    """One result as a rule sees it."""

    client: Params  # W_c, the host's weights (every tensor of the manifest)
    delta: Params  # Δ = W_c − W_base over the floating-point tensors
    staleness: int  # τ = W_s version at merge − the version the host started from
    epoch: int  # the workunit's epoch (1-based)
    # The job's latest evaluation when the update is merged: (W_s version evaluated, validation loss);
    # None when none is recorded or the rule does not read it (crowdtrain.assimilator.rules.control).
    validation: tuple[int, float] | None = None


class Rule(Protocol):
    def initial_state(self, server: Params) -> Params:
        """The state the rule keeps beside W_s (empty for a stateless rule).

        Its names, shapes and dtypes are fixed for the life of the job: `apply` changes the values
        only, so the parameter store can keep the state as one blob and update it in place.
        """
        ...

    def apply(self, server: Params, state: Params, update: Update) -> None:
        """Merge `update` into `server` and `state`, both in place (never replacing an array)."""
        ...


NORM_BLOCK = 1 << 16  # elements squared per step: 512 KB of float64, in cache


def sum_of_squares(flat: np.ndarray, buffer: np.ndarray) -> float:
    """Σ x² of a 1-d array in float64, block by block through `buffer` (float64), with numpy's own loops.

    Not a float64 copy and a BLAS dot: the copy cost as much as the sum, and BLAS's threads spun
    waiting for cores held by the other parameter servers and Redis (30-470 ms for 5M values on 2 cores).
    """
    total = 0.0
    for start in range(0, flat.size, buffer.size):
        block = buffer[: min(buffer.size, flat.size - start)]
        np.square(flat[start : start + block.size], out=block, dtype=np.float64)
        total += float(block.sum())
    return total


def params_norm(params: Params) -> float:
    """L2 norm over all floating-point tensors (integer counters are not parameters), summed in float64."""
    buffer = np.empty(NORM_BLOCK, np.float64)
    return float(sum(sum_of_squares(v.reshape(-1), buffer) for v in params.values() if v.dtype.kind == "f") ** 0.5)


def difference_and_norm(client: Params, base: Params) -> tuple[Params, float]:
    """Δ = W_c − W_base over the floating-point tensors of `base`, in their dtypes, and ||Δ|| summed in
    float64, in one pass: each block of Δ is squared while it is still in cache."""
    buffer = np.empty(NORM_BLOCK, np.float64)
    delta: Params = {}
    total = 0.0
    for name, wb in base.items():
        if wb.dtype.kind != "f":
            continue
        d = np.empty_like(wb)
        fd, fc, fb = d.reshape(-1), client[name].reshape(-1), wb.reshape(-1)
        for start in range(0, fd.size, NORM_BLOCK):
            stop = min(start + NORM_BLOCK, fd.size)
            total += sum_of_squares(np.subtract(fc[start:stop], fb[start:stop], out=fd[start:stop]), buffer)
        delta[name] = d
    return delta, total**0.5


def update_with_norm(base: Params, carried: Params, send: str, staleness: int, epoch: int) -> tuple[Update, float]:
    """`make_update`'s Update and ||Δ||, the norm the policy bounds (for weights, from the same pass as Δ)."""
    if send == "weights":
        delta, norm = difference_and_norm(carried, base)
        return Update(carried, delta, staleness, epoch), norm
    update = make_update(base, carried, send, staleness, epoch)
    return update, params_norm(update.delta)


def make_update(base: Params, carried: Params, send: str, staleness: int, epoch: int) -> Update:
    """The `Update` of a result that started from `base` (W_base, read-only).

    `carried` is what the result carries, as crowdtrain.core.updates.decode_update returns it: W_c
    when `send` is "weights"; otherwise Δ (float32) for each floating-point tensor and the client's
    own value of every other tensor. Whichever is missing of W_c and Δ is computed here, once:
    Δ = W_c − W_base, or W_c = W_base + Δ rounded to the model's dtypes. Both are in the model's
    dtypes. W_c may hold NaN or infinity when W_base + Δ overflows: the caller checks it.
    """
    floats = {k: v for k, v in base.items() if v.dtype.kind == "f"}
    if send == "weights":
        return Update(carried, {k: carried[k] - v for k, v in floats.items()}, staleness, epoch)
    client = dict(carried)
    with np.errstate(over="ignore"):
        for k, v in floats.items():
            client[k] = (np.asarray(v, np.float32) + carried[k]).astype(v.dtype, copy=False)
    delta = {k: np.asarray(carried[k]).astype(v.dtype, copy=False) for k, v in floats.items()}
    return Update(client, delta, staleness, epoch)
