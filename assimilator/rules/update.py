"""What every merge rule sees and promises: one `Update` at a time, W_s and the rule's state in place."""

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crowdtrain.core.tensors import Params

Tensors = Mapping[str, np.ndarray]  # named arrays, read only: Params, or a Scaled update


class Scaled(Mapping[str, np.ndarray]):
    """c·u for named arrays u and a number c, each tensor formed only when it is read, in its own dtype.

    The rules weight an update by numbers one after another (the step control's c, the staleness
    weight s(τ), the outer step's learning rate): scaling a Scaled notes the number and copies
    nothing, so the model-sized copies of each weighting (three for the default rule, 6-8 ms of a
    5M-parameter merge) become one tensor-sized product where the step reads it. The numbers are
    applied one by one, each rounded to the tensor's dtype, as model-sized copies would apply them:
    the result is the same to the bit.
    """

    def __init__(self, tensors: Tensors, factor: float):
        earlier = tensors.factors if isinstance(tensors, Scaled) else ()
        self.unscaled: Tensors = tensors.unscaled if isinstance(tensors, Scaled) else tensors
        # x·1 is x exactly: a factor of 1 is no step at all.
        self.factors: tuple[float, ...] = earlier + ((float(factor),) if factor != 1.0 else ())

    def __getitem__(self, name: str) -> np.ndarray:
        u = self.unscaled[name]
        if not self.factors:
            return u
        first, *rest = self.factors
        scaled: np.ndarray = u * np.asarray(first, u.dtype)
        for factor in rest:
            scaled *= np.asarray(factor, u.dtype)
        return scaled

    def __iter__(self) -> Iterator[str]:
        return iter(self.unscaled)

    def __len__(self) -> int:
        return len(self.unscaled)


@dataclass(frozen=True)
class Update:
    """One result as a rule sees it."""

    client: Params  # W_c, the host's weights (every tensor of the manifest)
    delta: Tensors  # Δ = W_c − W_base over the floating-point tensors (read only; a rule may pass c·Δ on)
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
# Values one BLAS dot sums, for accuracy: a float32 sum this short stays within ~1e-6 of the exact one,
# where one over millions of values can drift far more. (Blocks also keep each call short; whether a
# BLAS threads a dot depends on its build: numpy's OpenBLAS 0.3.31 took CPU time equal to wall time
# here for dots of 8,192 to 5M float32 values, so none threaded.)
DOT_BLOCK = 8192


def sum_of_squares(flat: np.ndarray, buffer: np.ndarray) -> float:
    """Σ x² of a 1-d array, summed in float64 across blocks; `buffer` (float64) is scratch.

    float32 and float64 values are summed DOT_BLOCK at a time by BLAS's dot (for 5M float32 values
    about 1 ms, against 5-7 ms for squaring them into float64 with numpy's loops, which every other
    dtype still takes, as does a float32 block whose squares overflow float32's range).
    """
    if flat.dtype not in (np.float32, np.float64) or not flat.flags.c_contiguous:
        return _float64_squares(flat, buffer)
    total = 0.0
    with np.errstate(over="ignore"):  # an overflowing block is summed again in float64
        for start in range(0, flat.size, DOT_BLOCK):
            x = flat[start : start + DOT_BLOCK]
            s = float(np.dot(x, x))
            total += s if math.isfinite(s) else _float64_squares(x, buffer)
    return total


def _float64_squares(flat: np.ndarray, buffer: np.ndarray) -> float:
    """Σ x² with every square taken in float64, block by block through `buffer`, with numpy's own loops."""
    total = 0.0
    for start in range(0, flat.size, buffer.size):
        block = buffer[: min(buffer.size, flat.size - start)]
        np.square(flat[start : start + block.size], out=block, dtype=np.float64)
        total += float(block.sum())
    return total


def params_norm(params: Tensors) -> float:
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
