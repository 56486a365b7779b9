"""One expert on its host: its module, its optimizer and the two calls it answers. No I/O.

backward recomputes the forward pass from the inputs it is sent (the host keeps no activations
between calls: gradient checkpointing, as in Learning@home), returns the gradient of the inputs and
takes one optimizer step. A lock orders the calls of one expert: a forward reads the weights that
the last backward wrote, whole.
"""

import threading

import numpy as np
import torch

from crowdtrain.core.experts import ExpertLayout, build_expert


class ExpertFailed(RuntimeError):
    """The expert could not answer a call; the host stays up and the caller drops this expert."""


class Expert:
    def __init__(self, layout: ExpertLayout, uid: str, seed: int = 0):
        self.uid = uid
        self.module = build_expert(layout, uid, seed)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=layout.lr)
        self.steps = 0
        self._lock = threading.Lock()

    def forward(self, x: np.ndarray) -> np.ndarray:
        with self._lock, torch.no_grad():
            y = self.module(torch.from_numpy(x)).numpy()
        return self._finite(y, "output")

    def backward(self, x: np.ndarray, grad_y: np.ndarray) -> np.ndarray:
        """The gradient of the inputs `x` given the outputs' gradient `grad_y`; then one optimizer step
        on the parameters' gradient. A step that would make a weight non-finite is not taken."""
        with self._lock:
            inputs = torch.from_numpy(np.array(x)).requires_grad_(True)
            self.optimizer.zero_grad(set_to_none=True)
            self.module(inputs).backward(torch.from_numpy(grad_y))
            assert inputs.grad is not None
            grad_x = self._finite(inputs.grad.numpy(), "input gradient")
            if not all(torch.isfinite(p.grad).all() for p in self.module.parameters() if p.grad is not None):
                raise ExpertFailed(f"expert {self.uid}: its parameters' gradient is not finite; no step taken")
            self.optimizer.step()
            self.steps += 1
        return grad_x

    def _finite(self, out: np.ndarray, what: str) -> np.ndarray:
        if not np.isfinite(out).all():
            raise ExpertFailed(f"expert {self.uid}: its {what} is not finite")
        return out
