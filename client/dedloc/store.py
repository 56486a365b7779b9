"""A torch.distributed Store whose keys live on the scheduler (volunteers reach only the scheduler).

One store per (job, step, attempt, group): the scheduler keeps its keys under that prefix in Redis
and lets only the group's members touch them while the attempt runs. A process group built on it
(`torch.distributed.ProcessGroupGloo(store, rank, size, timeout)`) lasts one round; no global
`init_process_group` state outlives it.
"""

import base64
import time
from datetime import timedelta

import torch.distributed as dist

from crowdtrain.client.dedloc.api import PeerAPI, b64


class RoundStore(dist.Store):
    def __init__(self, api: PeerAPI, step: int, attempt: int, timeout: float):
        super().__init__()
        self.api, self.step, self.attempt = api, step, attempt
        self._timeout = timeout

    def _op(self, op: str, **fields):
        return self.api.store(self.step, self.attempt, op, **fields)

    def set(self, key: str, value) -> None:
        self._op("set", key=key, value=b64(value))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout
        while True:
            reply = self._op("get", key=key, wait=1.0)
            if reply.found:
                return base64.b64decode(reply.value or "")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous key {key!r} did not appear within {self._timeout}s")

    def add(self, key: str, amount: int) -> int:
        return int(self._op("add", key=key, amount=int(amount)).number)

    def compare_set(self, key: str, expected, desired) -> bytes:
        reply = self._op("compare_set", key=key, expected=b64(expected), value=b64(desired))
        return base64.b64decode(reply.value or "")

    def check(self, keys: list[str]) -> bool:
        return self._op("check", keys=list(keys)).found

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else self._timeout
        deadline = time.monotonic() + seconds
        while not self._op("check", keys=list(keys), wait=1.0).found:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous keys {keys} did not appear within {seconds}s")

    def delete_key(self, key: str) -> bool:
        return self._op("delete", key=key).found

    def num_keys(self) -> int:
        raise NotImplementedError("the round store does not count keys")
