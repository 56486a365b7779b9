"""The optimizer states a client's compute slots carry from one workunit of a job to the next.

With a recipe's `training.keep_optimizer_state`, a workunit starts from the optimizer state (Adam
moments and step, SGD momentum) that an earlier workunit of the same job on this client ended with,
instead of from zero. The pool holds, per job, the states of the slots that are not training it:
a slot that starts a workunit takes the one that came back last (its own, when it trains the job's
workunits one after another) and puts back the one its training ended with, so a job never has
more states than slots train it at once. This is what the simulator's `keep_optimizer_state` does
(crowdtrain.sim.training).

A state belongs to one recipe: its key is a hash of the recipe's model and training sections, and a
job whose recipe changes drops the states it had. The pool is bounded in bytes; past the bound the
least recently used states go first. It lives in memory only: a restarted client starts every job's
optimizer from zero again (a checkpoint-resumed workunit still resumes from its own checkpoint).
"""

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from crowdtrain.core.schemas import Recipe
from crowdtrain.core.tensors import Params

DEFAULT_MAX_BYTES = 512 * 2**20


def recipe_key(recipe: Recipe) -> str:
    """What an optimizer state depends on: the sha256 of the recipe's model and training sections."""
    text = json.dumps({"model": recipe.model, "training": recipe.training}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def keeps_optimizer_state(recipe: Recipe) -> bool:
    """Whether the recipe asks slots to keep their optimizer state (recipes from before the field: no)."""
    return bool(recipe.training.get("keep_optimizer_state", False))


def state_bytes(state: Params) -> int:
    return sum(int(a.nbytes) for a in state.values())


@dataclass
class _JobStates:
    key: str
    free: list[Params] = field(default_factory=list)  # the slots' states, the last one back at the end


class OptimizerStates:
    """Per job, the optimizer states of the slots not training it; thread-safe, bounded in bytes (LRU)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self._jobs: OrderedDict[int, _JobStates] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def held(self, job_id: int) -> int:
        """How many states the pool holds for `job_id`."""
        with self._lock:
            job = self._jobs.get(job_id)
            return 0 if job is None else len(job.free)

    def take(self, job_id: int, key: str) -> Params | None:
        """The state a slot starting a workunit of `job_id` (recipe `key`) continues from, removed from
        the pool; None when there is none (start from zero). A changed recipe drops the job's states."""
        with self._lock:
            job = self._current(job_id, key)
            self._jobs.move_to_end(job_id)
            return job.free.pop() if job.free else None

    def put(self, job_id: int, key: str, state: Params) -> None:
        """Keep the state a slot's training of `job_id` (recipe `key`) ended with, for the next workunit;
        then drop the least recently used states until the pool is within its bound. A state larger
        than the bound is not kept (and drops none)."""
        with self._lock:
            job = self._current(job_id, key)
            if state_bytes(state) > self.max_bytes:
                return
            job.free.append(state)
            self._jobs.move_to_end(job_id)
            self._evict()

    def _current(self, job_id: int, key: str) -> _JobStates:
        job = self._jobs.get(job_id)
        if job is None or job.key != key:
            job = self._jobs[job_id] = _JobStates(key)
        return job

    def _bytes(self) -> int:
        return sum(state_bytes(s) for job in self._jobs.values() for s in job.free)

    def _evict(self) -> None:
        total = self._bytes()
        while total > self.max_bytes and self._jobs:
            job_id, job = next(iter(self._jobs.items()))
            if not job.free:
                del self._jobs[job_id]
                continue
            total -= state_bytes(job.free.pop(0))  # the job's oldest state first
