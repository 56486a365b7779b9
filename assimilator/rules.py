"""Merge rules and alpha schedules: pure functions over dicts of named numpy arrays.

A rule is picked by `assimilation.rule` (`make_rule`). It sees one result at a time as an `Update`
and changes W_s, and its own state (named arrays kept beside W_s in Redis and written in the same
exactly-once transaction: assimilator.paramstore), in place. Policy that applies to every rule
(staleness bound, update-norm bound, clipping, refusals) lives in assimilator.policy and wraps the
rule; a rule never refuses. No I/O.
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crowdtrain.tensors import Params


@dataclass(frozen=True)
class Update:
    """One result as a rule sees it."""

    client: Params  # W_c, the host's weights (every tensor of the manifest)
    delta: Params  # Δ = W_c − W_base over the floating-point tensors
    staleness: int  # τ = W_s version at merge − the version the host started from
    epoch: int  # the workunit's epoch (1-based)


class Rule(Protocol):
    def initial_state(self, server: Params) -> Params:
        """The state the rule keeps beside W_s (empty for a stateless rule)."""
        ...

    def apply(self, server: Params, state: Params, update: Update) -> None:
        """Merge `update` into `server` and `state`, both in place."""
        ...


@dataclass(frozen=True)
class VcAsgd:
    """The paper's rule: W_s <- alpha_e * W_s + (1 - alpha_e) * W_c."""

    schedule: str
    alpha: float

    def initial_state(self, server: Params) -> Params:
        return {}

    def apply(self, server: Params, state: Params, update: Update) -> None:
        merge_vc_asgd(server, update.client, alpha_for_epoch(self.schedule, self.alpha, update.epoch), out=server)


def make_rule(assimilation: dict) -> Rule:
    """The merge rule a job's `assimilation` section (as stored: a dict) selects."""
    name = assimilation.get("rule", "vc-asgd")
    if name == "vc-asgd":
        return VcAsgd(assimilation.get("schedule", "constant"), assimilation.get("alpha", 0.7))
    raise ValueError(f"unknown merge rule {name!r}")


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
    return total ** 0.5
