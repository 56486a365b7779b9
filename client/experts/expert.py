"""One expert on its host: its module (crowdtrain.core.zoo_experts), its optimizer and the two calls it
answers. No I/O.

backward recomputes the forward pass from the inputs it is sent (the host keeps no activations
between calls: gradient checkpointing, as in Learning@home), returns the gradient of the inputs and
takes one optimizer step. A lock orders the calls of one expert: a forward reads the weights that
the last backward wrote, whole.
"""

import threading

import numpy as np
import torch

from crowdtrain.core.experts import ExpertLayout, layout_has
from crowdtrain.core.tensors import check_layout, encode, header_limits, views
from crowdtrain.core.zoo_experts import build_expert


class ExpertFailed(RuntimeError):
    """The expert could not answer a call; the host stays up and the caller drops this expert."""


class Expert:
    def __init__(self, layout: ExpertLayout, uid: str, seed: int | None = None):
        if not layout_has(layout, uid):
            raise ValueError(f"expert {uid!r} is not in the layout (layers {layout.layers}, grid {layout.grid})")
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

    def state(self) -> tuple[int, bytes]:
        """(steps, checkpoint): the expert's weights and its optimizer's state, as safetensors, taken
        between calls so that they belong together."""
        with self._lock:
            tensors = {f"param/{n}": p.detach().numpy().copy() for n, p in self.module.named_parameters()}
            for n, p in self.module.named_parameters():
                moments = self.optimizer.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in moments:
                        tensors[f"adam/{key}/{n}"] = moments[key].numpy().copy()
            tensors["steps"] = np.array([self.steps], np.int64)
            return self.steps, encode(tensors)

    def _read(self, checkpoint: bytes) -> dict[str, np.ndarray]:
        """The tensors of `checkpoint`, checked against this expert; ValueError when they are not its."""
        expected = self.state_manifest()
        tensors = views(checkpoint, max_header_bytes=header_limits(expected)[0], max_tensors=len(expected))
        names = set(tensors)
        if "steps" not in names or not {k for k in expected if k.startswith("param/")} <= names:
            raise ValueError(f"expert {self.uid}: a checkpoint without its weights or step count")
        check_layout({k: tensors[k] for k in names}, {k: expected[k] for k in names}, f"expert {self.uid}")
        if not all(np.isfinite(t).all() for t in tensors.values()):
            raise ValueError(f"expert {self.uid}: a checkpoint with NaN or infinite values")
        return tensors

    def average_with(self, checkpoint: bytes) -> None:
        """Replicas re-synchronised: the weights become the mean of this expert's and those of
        `checkpoint` (another replica's), and so do Adam's moments where both have them; the step
        count stays this replica's. ValueError, leaving the expert as it was, when they are not this expert's."""
        tensors = self._read(checkpoint)
        with self._lock, torch.no_grad():
            for n, p in self.module.named_parameters():
                p.mul_(0.5).add_(torch.from_numpy(np.array(tensors[f"param/{n}"])), alpha=0.5)
                moments = self.optimizer.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in moments and f"adam/{key}/{n}" in tensors:
                        moments[key].mul_(0.5).add_(torch.from_numpy(np.array(tensors[f"adam/{key}/{n}"])), alpha=0.5)

    def restore(self, checkpoint: bytes) -> None:
        """Take the weights and optimizer state of `checkpoint` (`state`'s bytes, perhaps from another
        host); ValueError, leaving the expert as it was, when they are not this expert's."""
        tensors = self._read(checkpoint)
        names = set(tensors)
        with self._lock:
            params = dict(self.module.named_parameters())
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(torch.from_numpy(np.array(tensors[f"param/{n}"])))
            self.optimizer.state.clear()
            steps = int(tensors["steps"][0])
            for n, p in params.items():
                if f"adam/exp_avg/{n}" in names and f"adam/exp_avg_sq/{n}" in names:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(float(steps)),
                        "exp_avg": torch.from_numpy(np.array(tensors[f"adam/exp_avg/{n}"])),
                        "exp_avg_sq": torch.from_numpy(np.array(tensors[f"adam/exp_avg_sq/{n}"])),
                    }
            self.steps = steps

    def state_manifest(self) -> dict[str, tuple[list[int], str]]:
        """Every tensor a checkpoint of this expert may hold: name -> (shape, dtype)."""
        out: dict[str, tuple[list[int], str]] = {"steps": ([1], "int64")}
        for n, p in self.module.named_parameters():
            for name in (f"param/{n}", f"adam/exp_avg/{n}", f"adam/exp_avg_sq/{n}"):
                out[name] = (list(p.shape), "float32")
        return out

    def _finite(self, out: np.ndarray, what: str) -> np.ndarray:
        if not np.isfinite(out).all():
            raise ExpertFailed(f"expert {self.uid}: its {what} is not finite")
        return out
