"""One expert on its host: its module (crowdtrain.core.zoo_experts), its optimizer and the two calls it
answers. No I/O.

backward recomputes the forward pass from the inputs it is sent (the host keeps no activations
between calls: gradient checkpointing, as in Learning@home), returns the gradient of the inputs and
takes one optimizer step. A lock orders the calls of one expert: a forward reads the weights that
the last backward wrote, whole.

An expert whose checkpoints are kept (`keep_checkpoints`, a leasing host's) takes a snapshot of its
weights and optimizer state inside the step that reaches each half of its checkpoint interval, so the
snapshot holds exactly that step, and hands it to its host's uploader (`take_snapshot`, `stored`). A step
that would leave it more than the interval past its last stored checkpoint waits for the upload, and is
refused (ExpertFailed: the caller drops this expert for the batch) if the upload does not come within
`wait` seconds: a host that dies loses at most `checkpoint_every` steps of each expert.
"""

import threading
from collections.abc import Callable

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
        self._stored_cond = threading.Condition(self._lock)
        self._bound = 0  # most steps past the stored checkpoint (0: checkpoints not kept)
        self._stored_step = self._snapshot_step = 0
        self._snapshot: tuple[int, bytes] | None = None
        self._wait, self._notify = 0.0, lambda: None

    def keep_checkpoints(self, every: int, wait: float, notify: Callable[[], None]) -> None:
        """Snapshot every `max(1, every // 2)` steps and call `notify`; never run more than `every` steps
        past the last stored checkpoint (the one restored, or the initial weights, count as stored)."""
        with self._lock:
            self._bound, self._wait, self._notify = every, wait, notify
            self._stored_step = self._snapshot_step = self.steps

    def take_snapshot(self) -> tuple[int, bytes] | None:
        """The newest snapshot not yet handed over: (step, checkpoint), or None."""
        with self._lock:
            snapshot, self._snapshot = self._snapshot, None
            return snapshot

    def stored(self, step: int) -> None:
        """The checkpoint of `step` is in storage: steps blocked on it may go on."""
        with self._lock:
            self._stored_step = max(self._stored_step, step)
            self._stored_cond.notify_all()

    @property
    def stored_step(self) -> int:
        return self._stored_step

    def forward(self, x: np.ndarray) -> np.ndarray:
        with self._lock, torch.no_grad():
            y = self.module(torch.from_numpy(x)).numpy()
        return self._finite(y, "output")

    def backward(self, x: np.ndarray, grad_y: np.ndarray) -> np.ndarray:
        """The gradient of the inputs `x` given the outputs' gradient `grad_y`; then one optimizer step
        on the parameters' gradient. A step that would make a weight non-finite is not taken."""
        with self._lock:
            if self._bound and not self._stored_cond.wait_for(
                lambda: self.steps + 1 - self._stored_step <= self._bound, self._wait
            ):
                raise ExpertFailed(
                    f"expert {self.uid}: step {self.steps + 1} waits for the checkpoint of step "
                    f"{self._snapshot_step} to be stored; no step taken"
                )
            inputs = torch.from_numpy(np.array(x)).requires_grad_(True)
            self.optimizer.zero_grad(set_to_none=True)
            self.module(inputs).backward(torch.from_numpy(grad_y))
            assert inputs.grad is not None
            grad_x = self._finite(inputs.grad.numpy(), "input gradient")
            if not all(torch.isfinite(p.grad).all() for p in self.module.parameters() if p.grad is not None):
                raise ExpertFailed(f"expert {self.uid}: its parameters' gradient is not finite; no step taken")
            self.optimizer.step()
            self.steps += 1
            if self._bound and self.steps - self._snapshot_step >= max(1, self._bound // 2):
                self._snapshot_step = self.steps
                self._snapshot = self._state()
                self._notify()
        return grad_x

    def state(self) -> tuple[int, bytes]:
        """(steps, checkpoint): the expert's weights and its optimizer's state, as safetensors, taken
        between calls so that they belong together."""
        with self._lock:
            return self._state()

    def _state(self) -> tuple[int, bytes]:
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
            self.steps = self._stored_step = self._snapshot_step = steps
            self._snapshot = None

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
