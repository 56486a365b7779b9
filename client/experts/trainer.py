"""A trainer's model and steps: a dense trunk around the remote mixture-of-experts layers
(crowdtrain.client.experts.mixture). The trunk's parameters live here; the experts' live on their
hosts, which step them on each backward call."""

import copy
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np
import torch
from torch import nn

from crowdtrain.client.cpu_kernels import guard_cpu_training
from crowdtrain.client.experts.mixture import ExpertClient, RemoteExperts
from crowdtrain.core.zoo_experts import MixtureTrunk


class MixtureClassifier(nn.Module):
    """A trainer's model: the dense `trunk` (crowdtrain.core.zoo_experts.MixtureTrunk, whose parameters
    are all the trainer holds) with its mixture layers computed by the remote experts `client` calls."""

    def __init__(self, trunk: MixtureTrunk, client: ExpertClient):
        super().__init__()
        self.trunk = trunk
        self.remote = RemoteExperts(client)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.trunk(x, self.remote)
        return logits

    @property
    def dropped_rows(self) -> int:
        return self.remote.dropped_rows


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: np.ndarray, y: np.ndarray) -> float:
    """One step on the batch (x, y): the trunk's by `optimizer`, the experts' on their hosts. Its loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 512) -> float:
    with torch.no_grad():
        right = sum(
            int((model(torch.from_numpy(x[i : i + batch])).argmax(1).numpy() == y[i : i + batch]).sum())
            for i in range(0, len(x), batch)
        )
    return right / len(x)


# A micro-batch's trunk step is taken at the learning rate over (1 + staleness) ** STALENESS_POWER,
# its staleness being the steps other micro-batches took since it read the trunk's weights
# (staleness-aware asynchronous SGD, Zhang et al., IJCAI 2016, divide by the staleness itself). Measured
# (benchmarks/expert_parallel.py, 8 in flight, 10% of calls lost): the accuracy gap to a dense model of
# equal FLOPs at equal examples went from 1.0-1.4 points to 0.2.
STALENESS_POWER = 0.5


class PipelinedTrainer:
    """Keeps `in_flight` micro-batches going through the model at once, as Learning@home's trainers do to
    hide the network's latency behind other batches' work. Each micro-batch runs on a replica of the
    trunk (one per thread, sharing the expert client) loaded with the trunk's parameters when it starts,
    and applies its gradient when it ends: the trunk's steps are asynchronous, each stale by at most
    `in_flight - 1` steps, and a stale step is taken at a smaller learning rate (STALENESS_POWER). The
    experts' steps happen on their hosts, at each backward call."""

    def __init__(self, model: MixtureClassifier, optimizer: torch.optim.Optimizer, in_flight: int):
        guard_cpu_training()  # the trunk trains on the CPU
        self.model, self.optimizer, self.in_flight = model, optimizer, in_flight
        self.steps, self.examples, self.loss_sum = 0, 0, 0.0
        self._lock = threading.Lock()
        self._replicas = threading.local()

    def _replica(self) -> nn.Module:
        replica = getattr(self._replicas, "model", None)
        if replica is None:
            client = self.model.remote.client
            shared = {id(client): client}
            with self._lock:
                replica = copy.deepcopy(self.model, memo=shared)
            self._replicas.model = replica
        return replica

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One micro-batch's forward, backward and trunk step; its loss. Safe to call from many threads."""
        replica = self._replica()
        with self._lock, torch.no_grad():
            for mine, theirs in zip(replica.parameters(), self.model.parameters(), strict=True):
                mine.copy_(theirs)
            read_at = self.steps
        replica.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(replica(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        with self._lock:
            for p, mine in zip(self.model.parameters(), replica.parameters(), strict=True):
                p.grad = mine.grad
            self._stale_step(self.steps - read_at)
            self.steps += 1
            self.examples += len(y)
            self.loss_sum += float(loss.detach()) * len(y)
        return float(loss.detach())

    def _stale_step(self, staleness: int) -> None:
        """The optimizer's step, at its learning rates scaled down for `staleness` (then put back)."""
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] / (1 + staleness) ** STALENESS_POWER
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
                group["lr"] = lr

    def train(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], done: Callable[[], bool] = lambda: False) -> None:
        """Train on `batches`, `in_flight` at a time, until they run out or `done()` says so (checked as
        each one ends). An exception of a micro-batch, or of `batches` (a cancelled workunit), ends the
        training once the micro-batches running have ended."""
        with ThreadPoolExecutor(self.in_flight, thread_name_prefix="micro-batch") as pool:
            running = {pool.submit(self.step, *batch) for batch in itertools.islice(batches, self.in_flight)}
            while running:
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for f in finished:
                    f.result()
                    batch = None if done() else next(batches, None)
                    if batch is not None:
                        running.add(pool.submit(self.step, *batch))
