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
