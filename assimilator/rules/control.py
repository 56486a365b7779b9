"""A server step that follows the job's validation loss: the "bold driver" of Vogl et al. (1988,
"Accelerating the convergence of the back-propagation method") and Battiti (1989), applied to the
step a rule takes on each asynchronous update. No I/O.

How large a step the stream of updates tolerates depends on the task: where large batches train as
well as small ones, T results in flight may together move W_s by about √T single steps or more; where
they do not, by about one (their mean). A fixed step is wrong for one kind of task or the other (a
per-result (1 + τ)^-0.5 trained the large tabular task in 2.3x the single-process examples and
diverged on mnist1d). The job already measures what tells them apart: W_s's validation loss, after
each evaluation. The step is scaled by c, kept in the rule's state, and moved once per evaluation:

- the loss above the previous evaluation's by more than TOLERANCE (or not finite): c shrinks by
  SHRINK (to the floor at least): the step overshoots;
- the loss below the previous evaluation's: c grows by GROW (to 1 at most, the inner rule's full step);
- anything in between leaves c as it is.

c starts at the floor and grows while the loss falls, so a task that tolerates only small steps never
sees a large one for long. A rise is judged against the previous evaluation, not the lowest so far:
against the lowest, the loss's own spread between evaluations late in training (5-15% on the large
tabular task at the full step, which reaches its target) halved c again at every evaluation of one
bump, and held it near the floor. Each evaluation counts once: the update carries the version of W_s
that was evaluated last (`Update.validation`), and the state remembers the last version it acted on.

Measured with the (1 + τ)^-0.5 inner step, late snapshot binding, 8 slots (docs/benchmarks.md, "A step
that follows the validation loss"): on the real system, tabular-large-short-kept in 1.37x the
single-process examples (the default rule 2.18x), mnist1d-short-kept 4.57x (the default 4.48x), the
example job's long workunits 11.8x (the default 7.72x); in the simulator, mnist1d-short-kept 6.48x
where the inner step alone diverged.
"""

import math
from dataclasses import dataclass, replace

import numpy as np

from crowdtrain.assimilator.rules.update import Rule, Scaled, Update
from crowdtrain.core.tensors import Params

GROW = 1.1  # c's factor at a new lowest validation loss
SHRINK = 0.5  # c's factor at a loss above the lowest by more than TOLERANCE
TOLERANCE = 0.05  # relative: a loss this close to the lowest is noise, not a rise
SCALE, BEST, LAST = "control.scale", "control.best", "control.last"  # 0-d: c; the lowest and the latest loss
SEEN = "control.seen"  # 0-d: the version of W_s whose evaluation c last followed


@dataclass(frozen=True)
class LossControlled:
    """`inner`'s step on c·Δ, c following the validation loss (see the module docstring)."""

    inner: Rule
    floor: float = 1.0 / 16

    def __post_init__(self) -> None:
        if not 0 < self.floor <= 1:
            raise ValueError(f"step_floor must lie in (0, 1], got {self.floor}")

    def initial_state(self, server: Params) -> Params:
        control = {
            SCALE: np.array(self.floor, np.float64),
            BEST: np.array(math.inf, np.float64),
            LAST: np.array(math.inf, np.float64),
            SEEN: np.array(-1, np.int64),
        }
        return self.inner.initial_state(server) | control

    def scale(self, state: Params, validation: tuple[int, float] | None) -> float:
        """c after the evaluation `validation` (version, loss), which is acted on once; `state` updated."""
        c = float(state[SCALE])
        if validation is None or validation[0] <= int(state[SEEN]):
            return c
        version, loss = validation
        best, last = float(state[BEST]), float(state[LAST])
        state[SEEN][...], state[LAST][...] = version, loss
        if not math.isfinite(loss) or loss > last * (1.0 + TOLERANCE):
            c = max(self.floor, c * SHRINK)
        elif loss < last:
            c = min(1.0, c * GROW)
        state[BEST][...] = min(best, loss) if math.isfinite(loss) else best
        state[SCALE][...] = c
        return c

    def apply(self, server: Params, state: Params, update: Update) -> None:
        c = self.scale(state, update.validation)
        self.inner.apply(server, state, replace(update, delta=Scaled(update.delta, c)))
