"""Throttling of failed authentication per client address, shared by every scheduler process.

A fixed window in Redis: the first failure from an address starts a window of WINDOW_SECONDS; once
`limit` failures are counted in it, every request from that address that presents a credential is
answered 429 (with Retry-After) until the window ends, before its credential is checked, so that
guessing stops instead of merely slowing down. Successful authentication is neither counted nor
delayed; it costs one Redis read. A work request, the most frequent, checks its budget in the same
round trip that counts it (`FailureBudget.admit`), after its authentication and before its transaction
commits: from a throttled address even the right token is answered 429 and changes nothing.
"""

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from crowdtrain.core import keys
from crowdtrain.core.refusals import Refusal, RefusalKind

WINDOW_SECONDS = 60

# FailureBudget.admit: KEYS[1] the address's failures, KEYS[2] a counters hash; ARGV[1] the limit, then
# pairs of counter name and amount.
_ADMIT = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used >= tonumber(ARGV[1]) then return {1, redis.call('TTL', KEYS[1])} end
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
return {0, 0}
"""
_ADMIT_SHA = hashlib.sha1(_ADMIT.encode()).hexdigest()


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

    def admit(self, counters_key: str, counters: Mapping[str, int]) -> None:
        """`check`, and if the address is not throttled, add `counters` to the hash `counters_key`:
        one round trip for a request that has both to do, and a refused request counts nothing. A
        caller that has changed something calls it before committing, so that a Throttled raised here
        undoes it."""
        args: list[str | int] = [self.limit]
        for name, n in counters.items():
            if n > 0:
                args += [name, n]
        keys_ = [keys.auth_failures(self.address), counters_key]
        try:
            throttled, ttl = self.r.evalsha(_ADMIT_SHA, 2, *keys_, *args)
        except redis.exceptions.NoScriptError:
            throttled, ttl = self.r.eval(_ADMIT, 2, *keys_, *args)
        if throttled:
            raise Throttled(self.address, max(int(ttl), 1))

    def spend(self) -> None:
        """Count one failure; the first of a window starts it (INCR keeps the expiry SET gave)."""
        key = keys.auth_failures(self.address)
        with self.r.pipeline(transaction=True) as pipe:
            pipe.set(key, 0, ex=WINDOW_SECONDS, nx=True)
            pipe.incr(key)
            pipe.execute()
