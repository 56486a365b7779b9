"""The hosts' side of the training simulator's events (crowdtrain.sim.training): an assignment's
download, its wait for a compute slot, its training, and the upload that follows.

HostSlots is mixed into the simulation, which owns the clock (`now`, `_at`, `_after`), the simulated
job (crowdtrain.sim.job.SimJob), the fleet and its draws; the server side, an upload's arrival and the
merge passes, is crowdtrain.sim.passes'. How long each step takes is crowdtrain.sim.hosts' model.
"""

from collections import deque

import numpy as np

from crowdtrain.client.trainers import examples_in, local_steps
from crowdtrain.client.trainers.pytorch import train
from crowdtrain.core.assimilationspec import UploadSpec
from crowdtrain.core.tensors import Manifest, Params
from crowdtrain.core.updates import decode_result, encode_result
from crowdtrain.server.services.local_work import host_speeds, local_fraction
from crowdtrain.sim.hosts import Fleet
from crowdtrain.sim.job import SimJob
from crowdtrain.sim.records import Assignment, ShardDeals
from crowdtrain.sim.result import Dispatch
from crowdtrain.workgen.datasets import Dataset

FETCHED, TRAINED, ARRIVE = "fetched", "trained", "arrive"
DEADLINE, BACK, POLL = "deadline", "back", "poll"


class HostSlots:
    """Hosts download what they lack, take compute slots in the order their assignments came, train
    as the client does, and ask for more the moment a slot stops training."""

    spec: dict
    fleet: Fleet
    job: SimJob
    data: Dataset
    deals: ShardDeals
    rng: np.random.Generator
    compute: bool
    now: float
    restart: float
    speeds: np.ndarray
    model_config: dict
    manifest: Manifest
    upload: UploadSpec
    upload_size: int
    caches: list[set[tuple[int, int]]]
    idle: deque[int]
    asks_at: list[float]
    fetched: list[deque[Assignment]]
    free_slots: list[int]
    slot_states: list[list[Params]]
    end_states: dict[int, Params]
    ended: dict[int, float]
    reports: deque[tuple[int, int, float]]
    trace: list[Dispatch]

    def _at(self, t: float, kind: str, payload: object) -> None:
        raise NotImplementedError

    def _after(self, delay: float, kind: str, payload: object) -> None:
        raise NotImplementedError

    def _start(self, a: Assignment) -> None:
        """A host took `a`: it downloads what it lacks, then waits for a compute slot."""
        self._at(a.deadline, DEADLINE, a)
        preempted = self.fleet.preempts(self.rng)
        a.local_fraction = self._local_fraction(a.host)
        self.trace.append(
            Dispatch(
                self.now,
                a.id,
                a.wu.id,
                a.wu.epoch,
                a.wu.shard,
                a.host,
                preempted,
                a.local_fraction,
                len(self.job.in_flight()),
            )
        )
        if preempted:
            self._at(self.now + self.restart, BACK, a)
            return
        key = self.job.shard_key(a.wu)
        size = len(self.deals.of(key[0])[key[1]])
        downloads = 1 + (key not in self.caches[a.host])
        self.caches[a.host].add(key)
        t = self.spec["training"]
        a.train_seconds = (
            self.fleet.work_seconds(size, t["local_epochs"])
            * a.local_fraction
            * self.fleet.jitter(self.rng)
            / self.speeds[a.host]
        )
        if not self.compute:
            a.client, a.upload_bytes = a.base, self.upload_size
            steps = local_steps(size, t["batch_size"], t["local_epochs"], a.local_fraction)
            a.examples = examples_in(steps, size, t["batch_size"])
        self._after(downloads * self.fleet.network_seconds, FETCHED, a)

    def _train_next(self, host: int) -> None:
        """Downloaded assignments take the host's free compute slots, in the order they came, and train."""
        while self.free_slots[host] and self.fetched[host]:
            a = self.fetched[host].popleft()
            self.free_slots[host] -= 1
            if self.fleet.late_snapshot:
                a.base_version, a.base = self.job.snapshot_version, self.job.snapshot
                if not self.compute:
                    a.client = a.base
            if self.compute:
                key = self.job.shard_key(a.wu)
                self._train(a, self.deals.of(key[0])[key[1]])
            self._at(self.now + a.train_seconds, TRAINED, a)

    def _trained(self, a: Assignment) -> None:
        """Training ended: the slot takes the next downloaded assignment, the client asks for one more
        (it holds `slots`, +1 with prefetch, not yet trained) and uploads this one meanwhile."""
        self.ended[a.id] = self.now
        self.free_slots[a.host] += 1
        if a.id in self.end_states:
            self.slot_states[a.host].append(self.end_states.pop(a.id))
        self._train_next(a.host)
        self.idle.append(a.host)
        self.asks_at[a.host] = self.now  # the client asks at once when a slot frees (its slot_freed)
        self._after(self.fleet.network_seconds, ARRIVE, a)

    def _local_fraction(self, host: int) -> float:
        """crowdtrain.server.services.local_work.fraction_for over the simulated hosts' recent reports."""
        t = self.spec["training"]
        if not t["dynamic_local_work"]:
            return 1.0
        speeds = host_speeds(self.reports)
        return local_fraction(speeds.get(host), speeds.values(), t["min_local_fraction"])

    def _train(self, a: Assignment, examples: np.ndarray) -> None:
        """Train as the client does, and set W_c to what the server decodes from its upload. With
        fleet.keep_optimizer_state, from the state its slot kept, which comes back when it ends."""
        recipe = {"model": self.model_config, "training": self.spec["training"], "seed": self.spec["seed"] + a.id}
        kept = self.slot_states[a.host]
        state = kept.pop() if kept and self.fleet.keep_optimizer_state else None
        result = train(
            recipe,
            a.base,
            self.data.x[examples],
            self.data.y[examples],
            local_fraction=a.local_fraction,
            optimizer_state=state,
        )
        if self.fleet.keep_optimizer_state and result.optimizer_state is not None:
            self.end_states[a.id] = result.optimizer_state
        blob = encode_result(result.params, a.base, self.upload)
        a.client = decode_result(blob, self.manifest, self.upload, a.base)
        a.examples, a.upload_bytes = result.examples, len(blob)
