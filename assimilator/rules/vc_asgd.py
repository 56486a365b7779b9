"""VC-ASGD, the paper's rule: W_s <- alpha_e * W_s + (1 - alpha_e) * W_c, with its alpha schedule. No I/O."""

from dataclasses import dataclass

import numpy as np

from crowdtrain.assimilator.rules.update import Update
from crowdtrain.core.tensors import Params


@dataclass(frozen=True)
class VcAsgd:
    """The paper's rule: W_s <- alpha_e * W_s + (1 - alpha_e) * W_c. Stateless."""

    schedule: str
    alpha: float

    def initial_state(self, server: Params) -> Params:
        return {}

    def apply(self, server: Params, state: Params, update: Update) -> None:
        merge_vc_asgd(server, update.client, alpha_for_epoch(self.schedule, self.alpha, update.epoch), out=server)


def alpha_for_epoch(schedule: str, alpha: float, epoch: int) -> float:
    """The VC-ASGD mixing weight for a result of `epoch` (1-based).

    `constant` returns `alpha`; `epoch` returns e/(e+1), so later epochs trust W_s more.
    """
    if schedule == "constant":
        return alpha
    if schedule == "epoch":
        if epoch < 1:
            raise ValueError(f"epochs are numbered from 1, got {epoch}")
        return epoch / (epoch + 1)
    raise ValueError(f"unknown alpha schedule {schedule!r}")


def merge_vc_asgd(server: Params, client: Params, alpha: float, out: Params | None = None) -> Params:
    """W_s <- alpha * W_s + (1 - alpha) * W_c for floating-point tensors.

    Integer tensors (counters such as BatchNorm's `num_batches_tracked`) keep the server's value.
    With `out=server` the update happens in place, without allocating a second model.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    result = out if out is not None else {}
    for name, ws in server.items():
        wc = client[name]
        if ws.dtype.kind != "f":
            result[name] = ws
            continue
        target = result.get(name) if out is not None else None
        if target is None or target is not ws:
            target = np.array(ws, copy=True)
        target *= np.asarray(alpha, dtype=ws.dtype)
        target += np.asarray(1.0 - alpha, dtype=ws.dtype) * wc
        result[name] = target
    return result


def update_norm(reference: Params, client: Params) -> float:
    """L2 norm of W_c - `reference` over all floating-point tensors (the policy measures against
    the snapshot the client started from, W_base)."""
    total = 0.0
    for name, ws in reference.items():
        if ws.dtype.kind == "f":
            d = client[name].astype(np.float64) - ws
            total += float(np.dot(d.ravel(), d.ravel()))
    return float(total**0.5)
