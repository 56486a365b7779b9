"""Throttling of failed authentication per client address, shared by every scheduler process.

A fixed window in Redis: the first failure from an address starts a window of WINDOW_SECONDS; once
`limit` failures are counted in it, every request from that address that presents a credential is
answered 429 (with Retry-After) until the window ends, before its credential is checked, so that
guessing stops instead of merely slowing down. Successful authentication is neither counted nor
delayed; it costs one Redis read.
"""

from dataclasses import dataclass

import redis

from crowdtrain.core import keys
from crowdtrain.core.refusals import Refusal, RefusalKind

WINDOW_SECONDS = 60


class Throttled(Refusal):
    kind = RefusalKind.throttled

    def __init__(self, address: str, retry_after: int):
        super().__init__(f"too many failed authentications from {address}; retry in {retry_after}s")
        self.retry_after = retry_after


@dataclass(frozen=True)
class FailureBudget:
    """One client address's allowance of failed authentications (`limit` per WINDOW_SECONDS)."""

    r: redis.Redis
    address: str
    limit: int

    def check(self) -> None:
        """Raise Throttled if the address has used up its failures in the current window."""
        key = keys.auth_failures(self.address)
        count = self.r.get(key)  # one round trip for every request; the window's end only when refused
        if count is not None and int(count) >= self.limit:
            raise Throttled(self.address, max(int(self.r.ttl(key)), 1))

    def spend(self) -> None:
        """Count one failure; the first of a window starts it (INCR keeps the expiry SET gave)."""
        key = keys.auth_failures(self.address)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.set(key, 0, ex=WINDOW_SECONDS, nx=True)
            pipe.incr(key)
            pipe.execute()
