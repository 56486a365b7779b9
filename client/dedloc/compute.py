"""The model a DeDLOC peer computes its gradients with: on the CPU, the parameters the peers agree on
themselves; on a GPU, a copy of them there.

The agreed parameters stay on the CPU, with the optimizer, on every peer: each applies a committed
average with the same CPU arithmetic, so a GPU peer holds the very parameters (digest) a CPU peer
does, and its state is accepted like theirs (crowdtrain.server.services.dedloc_states). The copy
takes the parameters after each step, and gives back its buffers (a normalisation's running
statistics, which its forward passes update) before they are digested or uploaded.
"""

import copy

import torch

from crowdtrain.client.cpu_kernels import guard_cpu_training
from crowdtrain.client.dedloc.accumulate import flat_grads


class ComputeCopy:
    def __init__(self, agreed: torch.nn.Module, device: str):
        self.agreed, self.device = agreed, device
        guard_cpu_training(device)
        self.model = agreed if device == "cpu" else copy.deepcopy(agreed).to(device)
        self.params = list(self.model.parameters())

    def summed_gradient(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The flattened gradient of the summed cross-entropy loss of (x, y), on the device (a
        vector the next call overwrites: add it to an accumulator)."""
        self.model.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(self.model(x.to(self.device)), y.to(self.device), reduction="sum")
        loss.backward()
        return flat_grads(self.params)

    @torch.no_grad()
    def take_parameters(self, buffers: bool) -> None:
        """The copy takes the agreed parameters, and with `buffers` their buffers too (a new state)."""
        if self.model is self.agreed:
            return
        for ours, agreed in zip(self.params, self.agreed.parameters(), strict=True):
            ours.copy_(agreed)
        if buffers:
            for buffer, agreed_buffer in zip(self.model.buffers(), self.agreed.buffers(), strict=True):
                buffer.copy_(agreed_buffer)

    @torch.no_grad()
    def give_buffers(self) -> None:
        """The agreed model takes the buffers the copy's forward passes updated."""
        if self.model is self.agreed:
            return
        for agreed, ours in zip(self.agreed.buffers(), self.model.buffers(), strict=True):
            agreed.copy_(ours)
