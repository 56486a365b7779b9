"""The peers of a DeDLOC job: who joined it, from which host, whether relayed, and when each was last
seen (one Redis hash per job, `keys.dedloc_peers`). A peer silent for longer than `liveness_window`
is left out of the next round (crowdtrain.server.services.dedloc). Every function takes the time `now`.
"""

import json
from dataclasses import asdict, dataclass

import redis

from crowdtrain.core import keys
from crowdtrain.core.dedlocspec import DedlocSpec


def liveness_window(spec: DedlocSpec) -> float:
    """A peer silent for longer than this is left out of the next round."""
    return max(3 * spec.report_interval, 3.0)


@dataclass(frozen=True)
class Peer:
    """A joined peer: its host, whether it is relayed, when it was last seen and when it joined."""

    host_id: int
    relayed: bool
    last_seen: float
    joined: float = 0.0


class NotAMember(Exception):
    """The peer has not joined the job, belongs to another host, or is no member of the reduction."""


def peers(r: redis.Redis, job_id: int) -> dict[str, Peer]:
    return {keys.text(k): Peer(**json.loads(v)) for k, v in r.hgetall(keys.dedloc_peers(job_id)).items()}


def join(r: redis.Redis, job_id: int, peer_id: str, host_id: int, relayed: bool, now: float) -> None:
    r.hset(keys.dedloc_peers(job_id), peer_id, json.dumps(asdict(Peer(host_id, relayed, now, now))))


def touch(r: redis.Redis, job_id: int, peer_id: str, host_id: int, now: float) -> Peer:
    raw = r.hget(keys.dedloc_peers(job_id), peer_id)
    if raw is None:
        raise NotAMember(f"peer {peer_id} has not joined job {job_id}")
    peer = Peer(**json.loads(raw))
    if peer.host_id != host_id:
        raise NotAMember(f"peer {peer_id} belongs to another host")
    peer = Peer(peer.host_id, peer.relayed, now, peer.joined)
    r.hset(keys.dedloc_peers(job_id), peer_id, json.dumps(asdict(peer)))
    return peer


def live_peers(r: redis.Redis, job_id: int, spec: DedlocSpec, now: float) -> dict[str, Peer]:
    horizon = now - liveness_window(spec)
    return {p: v for p, v in peers(r, job_id).items() if v.last_seen >= horizon}
