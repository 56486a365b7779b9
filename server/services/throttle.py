"""Throttling of failed authentication per client address, shared by every scheduler process.

A fixed window in Redis: the first failure from an address starts a window of WINDOW_SECONDS; once
`limit` failures are counted in it, every further failure from that address is answered 429 (with
Retry-After) instead of 401/403 until the window ends, so that guessing stops instead of merely
slowing down. Only failures are throttled: a credential is checked first, and a right one is admitted
whatever its address's failures, so that one guesser behind a NAT or a shared proxy does not lock out
everyone else there. Successful authentication costs no Redis round trip.

The address is the one uvicorn gives the app: the peer's, unless the peer is a configured trusted proxy
(CROWDTRAIN_TRUSTED_PROXIES, crowdtrain.core.settings.Settings.trusted_proxies), whose X-Forwarded-For
is believed.
"""

from collections.abc import Mapping
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
        count = self.r.get(key)
        if count is not None and int(count) >= self.limit:
            raise Throttled(self.address, max(int(self.r.ttl(key)), 1))

    def fail(self) -> None:
        """One failed authentication: Throttled if the address had already used up its failures (the
        refusal is not counted again), else counted."""
        self.check()
        self.spend()

    def admit(self, counters_key: str, counters: Mapping[str, int]) -> None:
        """An authenticated request: add `counters` to the hash `counters_key` in one round trip. The
        budget is not consulted: a right credential is admitted from any address."""
        with self.r.pipeline(transaction=False) as pipe:
            for name, n in counters.items():
                if n > 0:
                    pipe.hincrby(counters_key, name, n)
            pipe.execute()

    def spend(self) -> None:
        """Count one failure; the first of a window starts it (INCR keeps the expiry SET gave)."""
        key = keys.auth_failures(self.address)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.set(key, 0, ex=WINDOW_SECONDS, nx=True)
            pipe.incr(key)
            pipe.execute()
