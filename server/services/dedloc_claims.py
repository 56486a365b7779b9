"""Service layer of the DeDLOC mode, the peers' claimed progress: the rate each peer has shown over
its committed rounds (`keys.dedloc_rates`) and the bound that puts on the examples it may claim now
(crowdtrain.core.dedloc.claim_bounds). A peer with no committed round is new. No lock is taken here:
the callers hold the job's rendezvous lock."""

import json
from collections.abc import Mapping

import redis

from crowdtrain.core import dedloc as math
from crowdtrain.core import keys
from crowdtrain.core.dedlocspec import DedlocSpec


def record_round(r: redis.Redis, job_id: int, examples: Mapping[str, int], seconds: Mapping[str, float]) -> None:
    """Add one committed round to each member's record: its examples and its accumulating seconds."""
    for peer, n in examples.items():
        raw = r.hget(keys.dedloc_rates(job_id), peer)
        seen = json.loads(raw) if raw is not None else {"examples": 0, "seconds": 0.0}
        seen = {"examples": seen["examples"] + max(0, n), "seconds": seen["seconds"] + max(0.0, seconds[peer])}
        r.hset(keys.dedloc_rates(job_id), peer, json.dumps(seen))


def rates(r: redis.Redis, job_id: int) -> dict[str, float]:
    """Established peers -> examples per second over their committed rounds."""
    out = {}
    for peer, raw in r.hgetall(keys.dedloc_rates(job_id)).items():
        seen = json.loads(raw)
        out[keys.text(peer)] = math.measured_rate(seen["examples"], seen["seconds"])
    return out


def established(r: redis.Redis, job_id: int) -> set[str]:
    return {keys.text(p) for p in r.hkeys(keys.dedloc_rates(job_id))}


def bounds(r: redis.Redis, job_id: int, spec: DedlocSpec, started: Mapping[str, float], now: float) -> dict[str, int]:
    """The most examples each peer of `started` (when it began accumulating for this step) may claim at `now`."""
    elapsed = {p: now - t for p, t in started.items()}
    return math.claim_bounds(rates(r, job_id), elapsed, spec.target_batch_size, spec.micro_batch_size)


def progress(r: redis.Redis, job_id: int, step: int, bound: Mapping[str, int]) -> dict[str, int]:
    """The examples the peers of `bound` have claimed for `step`, each counted up to its bound."""
    claims = {keys.text(k): int(v) for k, v in r.hgetall(keys.dedloc_progress(job_id, step)).items()}
    return math.bounded_claims({p: n for p, n in claims.items() if p in bound}, bound)


def overclaimed(r: redis.Redis, job_id: int, step: int, bound: Mapping[str, int]) -> set[str]:
    """Peers of `bound` that claim more examples for `step` than their bound."""
    claims = {keys.text(k): int(v) for k, v in r.hgetall(keys.dedloc_progress(job_id, step)).items()}
    return {p for p, n in claims.items() if p in bound and n > bound[p]}


def claimed(r: redis.Redis, job_id: int, step: int) -> set[str]:
    """Peers that claimed examples for `step`."""
    return {keys.text(k) for k, v in r.hgetall(keys.dedloc_progress(job_id, step)).items() if int(v) > 0}


def attend(r: redis.Redis, job_id: int, step: int, attempt: int, peer: str, ttl: int) -> None:
    """`peer` took part in the reduction (step, attempt): it is not the member the others waited on."""
    r.sadd(keys.dedloc_attended(job_id, step, attempt), peer)
    r.expire(keys.dedloc_attended(job_id, step, attempt), ttl)


def attended(r: redis.Redis, job_id: int, step: int, attempt: int) -> set[str]:
    return {keys.text(p) for p in r.smembers(keys.dedloc_attended(job_id, step, attempt))}


def shut_out(r: redis.Redis, job_id: int, peers: list[str]) -> None:
    """Exclude `peers` for good (new peers that timed out)."""
    if peers:
        r.sadd(keys.dedloc_shut_out(job_id), *peers)


def shut_out_peers(r: redis.Redis, job_id: int) -> set[str]:
    return {keys.text(p) for p in r.smembers(keys.dedloc_shut_out(job_id))}


def pass_over(r: redis.Redis, job_id: int, peers: list[str]) -> None:
    """Wait on `peers` no more until they next take part in a round (awaited and not ready in time)."""
    if peers:
        r.sadd(keys.dedloc_passed_over(job_id), *peers)


def take_part(r: redis.Redis, job_id: int, members: list[str]) -> None:
    """`members` take part in a round: they are waited on again."""
    if members:
        r.srem(keys.dedloc_passed_over(job_id), *members)


def passed_over(r: redis.Redis, job_id: int) -> set[str]:
    return {keys.text(p) for p in r.smembers(keys.dedloc_passed_over(job_id))}
