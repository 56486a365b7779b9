"""A step size that adapts to the task's gradient noise: AdaScale's gain (Johnson, Agrawal, Gu,
Guestrin 2020, "AdaScale SGD: A User-Friendly Algorithm for Distributed Training") over the stream of
asynchronous updates. No I/O.

About S = 1 + τ updates are in flight while one is computed. Were they one large batch, the
large-batch step that matches S small steps is r(S) small steps, with the gain

    r(S) = (σ² + ‖μ‖²) / (σ²/S + ‖μ‖²),    1 <= r <= S,

where μ is the mean update and σ² its variance: noisy updates (σ² >> ‖μ‖²) average out and each may
count fully (r = S), agreeing updates (σ² << ‖μ‖²) repeat one another and together may move W_s by
one step only (r = 1). Each update is applied with weight s = r(S)/S. Square-root scaling
((1 + τ)^-0.5) is the fixed weight in between; which end a task sits at is what the large-batch
bound of benchmarks/learning_efficiency.py measures, and what this rule estimates as it goes.

μ and σ² come from exponential moving averages over the updates merged (weight 1 − BETA each, bias
corrected): m of Δ and v of ‖Δ‖². For updates with mean μ and variance σ², E‖m‖² = ‖μ‖² + c·σ² with
c = (1 − BETA)/(1 + BETA) in the long run, and E v = ‖μ‖² + σ², so σ² = (v − ‖m‖²)/(1 − c). Until
WARMUP updates have been seen the rule takes the cautious end, r = 1.
"""

from dataclasses import dataclass

import numpy as np

from crowdtrain.assimilator.rules.outer import OuterOptimizer
from crowdtrain.assimilator.rules.update import Scaled, Update
from crowdtrain.core.tensors import Params

BETA = 0.9  # the moving averages' memory: about 2 / (1 - BETA) = 20 updates
WARMUP = 10  # updates before the gain is estimated
COUNT, SQUARES = "gain.count", "gain.squares"  # 0-d: updates seen; the moving average of ‖Δ‖²


def _mean(name: str) -> str:
    return f"gain.mean.{name}"


def gain(sigma2: float, mu2: float, s: float) -> float:
    """AdaScale's r(S) = (σ² + ‖μ‖²) / (σ²/S + ‖μ‖²), within [1, S]; 1 when there is nothing to scale."""
    total = sigma2 + mu2
    if s <= 1 or total <= 0:
        return 1.0
    return float(min(s, max(1.0, total / (sigma2 / s + mu2))))


@dataclass(frozen=True)
class GainDelta:
    """W_s moves by the outer optimizer's step on (r(1+τ)/(1+τ))·Δ, r estimated from the updates so far."""

    outer: OuterOptimizer

    def initial_state(self, server: Params) -> Params:
        means = {_mean(name): np.zeros_like(w) for name, w in server.items() if w.dtype.kind == "f"}
        counters = {COUNT: np.zeros((), np.int64), SQUARES: np.zeros((), np.float64)}
        return means | counters | self.outer.initial_state(server)

    def weight(self, state: Params, staleness: int) -> float:
        """s = r(S)/S for S = 1 + staleness, from the moving averages in `state`."""
        s = 1.0 + max(int(staleness), 0)
        n = int(state[COUNT])
        if n < WARMUP:
            return 1.0 / s
        correction = 1.0 - BETA**n
        v = float(state[SQUARES]) / correction
        m2 = sum(float(np.sum(np.square(m, dtype=np.float64))) for k, m in state.items() if k.startswith("gain.mean."))
        m2 /= correction**2
        c = (1.0 - BETA) / (1.0 + BETA)
        sigma2 = max(0.0, (v - m2) / (1.0 - c))
        mu2 = max(0.0, v - sigma2)
        return gain(sigma2, mu2, s) / s

    def apply(self, server: Params, state: Params, update: Update) -> None:
        w = self.weight(state, update.staleness)
        squares = 0.0
        for name, d in update.delta.items():
            mean = state[_mean(name)]
            mean *= BETA
            mean += (1.0 - BETA) * d.astype(mean.dtype, copy=False)
            squares += float(np.sum(np.square(d, dtype=np.float64)))
        state[SQUARES][...] = BETA * float(state[SQUARES]) + (1.0 - BETA) * squares
        state[COUNT][...] = int(state[COUNT]) + 1
        self.outer.step(server, state, Scaled(update.delta, w))
