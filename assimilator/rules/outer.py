"""Outer optimizers: a step on W_s from a (combined) update u taken as the pseudo-gradient g = −u.

DiLoCo (Douillard et al. 2023) showed that treating the average of the workers' updates as a
gradient and applying Nesterov momentum to it learns faster than averaging. Each optimizer keeps
its state as named arrays (`momentum.<name>`, `adam.m.<name>`, ..., and the number of steps taken,
`step`, a 0-d int64), created by `initial_state` and changed in place by `step`, so the parameter
store can write it in the same exactly-once transaction as W_s. Only the tensors named in u move:
integer tensors (counters) keep the server's value. No I/O.
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crowdtrain.assimilator.rules.update import Scaled, Tensors
from crowdtrain.core.tensors import Params

STEP = "step"


class OuterOptimizer(Protocol):
    def initial_state(self, server: Params) -> Params: ...

    def step(self, server: Params, state: Params, update: Tensors) -> None:
        """Move `server` (and `state`) in place by the update `update` (a descent direction)."""
        ...


def _zeros_like_floats(server: Params, prefix: str) -> Params:
    # Moments of half-precision weights would lose most of their bits: keep them in float32 at least.
    return {
        f"{prefix}{name}": np.zeros(w.shape, np.promote_types(w.dtype, np.float32))
        for name, w in server.items()
        if w.dtype.kind == "f"
    }


def _counter() -> np.ndarray:
    return np.zeros((), np.int64)


@dataclass(frozen=True)
class PlainStep:
    """W_s <- W_s + lr·u (plain SGD on g = −u); no state."""

    lr: float

    def initial_state(self, server: Params) -> Params:
        return {}

    def step(self, server: Params, state: Params, update: Tensors) -> None:
        for name, u in Scaled(update, self.lr).items():  # lr·u formed tensor by tensor, once
            server[name] += u


@dataclass(frozen=True)
class Nesterov:
    """SGD with Nesterov momentum, exactly as torch.optim.SGD(nesterov=True, dampening=0) steps:
    b <- μ·b + g;  W <- W − lr·(g + μ·b), with g = −u and b = 0 at first (torch's b_1 = g_1 is the same)."""

    lr: float
    momentum: float

    def initial_state(self, server: Params) -> Params:
        return _zeros_like_floats(server, "momentum.") | {STEP: _counter()}

    def step(self, server: Params, state: Params, update: Tensors) -> None:
        for name, u in update.items():
            b = state[f"momentum.{name}"]
            b *= self.momentum
            b -= u
            server[name] -= self.lr * (self.momentum * b - u)
        state[STEP] += 1


@dataclass(frozen=True)
class DelayedNesterov:
    """Delayed Nesterov momentum of Async Local-SGD (Liu et al. 2024, arXiv 2401.09135, Algorithm 3):
    the momentum changes only once every N = `delay` updates, from the average of the pseudo-gradients
    buffered since, and the steps in between are plain SGD steps scaled by 1/N, so stale updates
    arriving back to back are not amplified by momentum. With step t (1-based) and g_t = −u_t:

        Δ <- Δ + g_t
        t mod N = 0:  m <- β·m + Δ/N;  W <- W − lr·(g_t/N + β·m);  Δ <- 0
        otherwise:    W <- W − lr·g_t/N

    Over N updates W moves by −lr·(mean g + β·m): one Nesterov step on their mean. With N = 1 this
    is the Nesterov step above.
    """

    lr: float
    momentum: float
    delay: int

    def initial_state(self, server: Params) -> Params:
        return _zeros_like_floats(server, "momentum.") | _zeros_like_floats(server, "pending.") | {STEP: _counter()}

    def step(self, server: Params, state: Params, update: Tensors) -> None:
        state[STEP] += 1
        momentum_step = int(state[STEP]) % self.delay == 0
        for name, u in update.items():
            pending = state[f"pending.{name}"]
            pending -= u  # Δ accumulates g = −u
            server[name] += (self.lr / self.delay) * u
            if momentum_step:
                m = state[f"momentum.{name}"]
                m *= self.momentum
                m += pending / self.delay
                pending[...] = 0
                server[name] -= (self.lr * self.momentum) * m


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma and Ba 2015) with bias correction, on g = −u, stepping as torch.optim.Adam does:
    m <- β1·m + (1−β1)·g;  v <- β2·v + (1−β2)·g²;  W <- W − lr·m̂ / (√v̂ + eps).

    The rules scale an update by its staleness weight s(τ) before it gets here, so a stale update
    enters the moments damped: the staleness-gated input of CGAD.
    """

    lr: float
    betas: tuple[float, float]
    eps: float

    def initial_state(self, server: Params) -> Params:
        return _zeros_like_floats(server, "adam.m.") | _zeros_like_floats(server, "adam.v.") | {STEP: _counter()}

    def step(self, server: Params, state: Params, update: Tensors) -> None:
        beta1, beta2 = self.betas
        state[STEP] += 1
        t = int(state[STEP])
        correction1, correction2 = 1 - beta1**t, 1 - beta2**t
        for name, u in update.items():
            m, v = state[f"adam.m.{name}"], state[f"adam.v.{name}"]
            m *= beta1
            m -= (1 - beta1) * u
            v *= beta2
            v += (1 - beta2) * np.square(u)
            server[name] -= (self.lr / correction1) * m / (np.sqrt(v) / np.sqrt(correction2) + self.eps)


def make_outer(
    kind: str,
    lr: float,
    momentum: float = 0.9,
    delay: int = 4,
    betas: tuple[float, float] = (0.9, 0.99),
    eps: float = 1e-8,
) -> OuterOptimizer:
    """The outer optimizer the job spec's `outer_optimizer` names (`none` is the plain step)."""
    if kind == "none":
        return PlainStep(lr)
    if kind == "nesterov":
        return Nesterov(lr, momentum)
    if kind == "delayed-nesterov":
        return DelayedNesterov(lr, momentum, delay)
    if kind == "adam":
        return Adam(lr, (float(betas[0]), float(betas[1])), eps)
    raise ValueError(f"unknown outer_optimizer {kind!r}")
