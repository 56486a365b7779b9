"""Expert-parallel training's life cycle in the database: a mixture's experts leased to expert hosts,
leases renewed at each host's call and expired by the transitioner, checkpoints recorded, and the
routing table that trainers follow. The scheduler is the registry (where Learning@home looks experts
up in a DHT).

An expert's lease, as a table (one transaction per transition):

    free   --lease (a host asks, and passed the connect-back probe)-->  leased
    leased --renew (its host asks again before the lease ends)-->      leased
    leased --expire (the transitioner, once the lease has ended)-->    free
    leased --lease (another host asks after the lease ended)-->        leased (moved: it restores
                                                                        the last checkpoint)

Every change of an expert's host bumps the mixture's `route_version` and stamps the expert with it,
so that `routing_changes(since)` gives a trainer what changed since the version it holds. No I/O
here: the probe and the checkpoint's bytes are crowdtrain.server.services.experts'; what trainers report
of their calls, crowdtrain.server.ledger.expert_calls'.

Replication (the layout's `replicas` r): an expert has r rows, one per replica, each with the table
above. A host holds at most one replica of an expert, and every expert gets its first replica
leased before any gets a second. Each replica has its own checkpoints; a host that takes a replica
restores the newest checkpoint of any of them (`Lease.checkpoint_key`), and a serving replica averages
its weights with the newest of the others' (`Lease.peer_key`) at each of its own checkpoints.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.refusals import NotFound, Refusal, RefusalKind
from crowdtrain.server.ledger.models import Expert, Host, Mixture

LEASES_PER_CALL = 4  # experts one call may take, so that hosts asking together share them out
OPEN, CLOSED = "open", "closed"


@dataclass(frozen=True)
class Lease:
    """A replica of an expert that a host serves until `expires_at` unless it asks again; the newest
    checkpoint of any of the expert's replicas (to start from) and of its other replicas (to average with)."""

    uid: str
    replica: int
    expires_at: datetime
    checkpoint_key: str | None
    checkpoint_step: int
    peer_key: str | None = None
    peer_step: int = 0
    own_key: str | None = None  # this replica's own last checkpoint
    own_step: int = 0


@dataclass(frozen=True)
class Renewal:
    """A host's call as the ledger answers it: the mixture's layout, the host's leases after it, and
    whether a free expert was left that the host had room for (what a call with `grant` would lease)."""

    layout: ExpertLayout
    leases: list[Lease]
    more: bool = False


@dataclass(frozen=True)
class Route:
    """Where a trainer calls a replica of an expert: its host's base URL, or None while it has none."""

    uid: str
    replica: int
    url: str | None


def lease_seconds(layout: ExpertLayout) -> float:
    return layout.heartbeat_seconds * layout.lease_heartbeats


def create_mixture(db: sessionmaker[Session], name: str, layout: ExpertLayout) -> int:
    """A new open mixture with every expert of `layout`, none leased yet; its id."""
    with db.begin() as s:
        mixture = Mixture(name=name, layout=layout.model_dump(mode="json"), status=OPEN, route_version=0)
        s.add(mixture)
        s.flush()
        s.add_all(
            Expert(mixture_id=mixture.id, uid=uid, replica=replica, route_version=0, leases=0, checkpoint_step=0)
            for replica in range(layout.replicas)
            for layer in range(layout.layers)
            for uid in layout.uids(layer)
        )
        return mixture.id


def mixture_layout(db: sessionmaker[Session], mixture_id: int) -> ExpertLayout:
    with db.begin() as s:
        mixture = s.get(Mixture, mixture_id)
        if mixture is None:
            raise NotFound(f"mixture {mixture_id} does not exist")
        return ExpertLayout.model_validate(mixture.layout)


def locked_mixture(s: Session, mixture_id: int) -> Mixture:
    """The mixture, its row locked for `s`'s transaction; NotFound when there is none."""
    mixture = s.get(Mixture, mixture_id, with_for_update=True)
    if mixture is None:
        raise NotFound(f"mixture {mixture_id} does not exist")
    return mixture


def _route(mixture: Mixture, expert: Expert, host_id: int | None, url: str | None) -> None:
    mixture.route_version += 1
    expert.host_id, expert.url, expert.route_version = host_id, url, mixture.route_version


def renew_and_lease(
    db: sessionmaker[Session], host_id: int, mixture_id: int, url: str, capacity: int, now: datetime, grant: bool
) -> Renewal:
    """The mixture's layout and the host's leases after its call at `now`: those it holds renewed, and, with
    `grant` (it passed the connect-back probe), up to LEASES_PER_CALL free experts more while it holds
    fewer than `capacity` (lowest replica first, never a second replica of an expert it holds); without,
    whether there were any (Renewal.more: only then is a probe worth its cost). A lease
    that ended is not renewed (its expert may be another host's now): the host learns it has lost it by
    its absence. A quarantined host (its answers refused, `record_calls`) holds nothing: its experts are
    freed. One transaction."""
    with db.begin() as s:
        mixture = locked_mixture(s, mixture_id)
        layout = ExpertLayout.model_validate(mixture.layout)
        host = s.get_one(Host, host_id)
        if host.quarantined_until is not None and host.quarantined_until > now:  # it serves nothing
            free_hosts_experts(s, mixture, host_id)
            return Renewal(layout, [])
        until = now + timedelta(seconds=lease_seconds(layout))
        held = list(
            s.scalars(
                select(Expert)
                .where(Expert.mixture_id == mixture_id, Expert.host_id == host_id, Expert.lease_expires_at > now)
                .order_by(Expert.id)
            )
        )
        for expert in held:
            expert.lease_expires_at = until
            if expert.url != url:  # the host moved: trainers follow
                _route(mixture, expert, host_id, url)
        room = min(capacity - len(held), LEASES_PER_CALL)
        free = _free_experts(s, mixture_id, host_id, now, room * layout.replicas) if mixture.status == OPEN else []
        taken: set[str] = set()
        if grant and room > 0:
            for expert in free:
                if expert.uid in taken or len(taken) == room:
                    continue
                taken.add(expert.uid)
                _route(mixture, expert, host_id, url)
                expert.lease_expires_at = until
                expert.leases += 1
                held.append(expert)
        more = len(held) < capacity and any(expert.uid not in taken for expert in free)
        return Renewal(layout, _leases(s, mixture_id, held, until, layout.replicas), more=more)


def _free_experts(s: Session, mixture_id: int, host_id: int, now: datetime, limit: int) -> Sequence[Expert]:
    """Up to `limit` replicas of the mixture that no lease holds at `now`, of experts the host holds no
    replica of: lowest replica first."""
    if limit <= 0:
        return []
    holds = select(Expert.uid).where(
        Expert.mixture_id == mixture_id, Expert.host_id == host_id, Expert.lease_expires_at > now
    )
    return s.scalars(
        select(Expert)
        .where(
            Expert.mixture_id == mixture_id,
            or_(Expert.host_id.is_(None), Expert.lease_expires_at <= now),
            Expert.uid.not_in(holds),
        )
        .order_by(Expert.replica, Expert.id)
        .limit(limit)
    ).all()


def _leases(s: Session, mixture_id: int, held: list[Expert], until: datetime, replicas: int) -> list[Lease]:
    """The leases of the replicas `held`, each with the newest checkpoint of its expert's replicas and
    of its other replicas (one query for all of them; none with one replica per expert)."""
    if replicas == 1:  # the replica held is its expert's only one: its own checkpoint is the newest
        rows: Sequence[tuple[str, int, int, str | None]] = [
            (e.uid, e.replica, e.checkpoint_step, e.checkpoint_key) for e in held
        ]
    elif held:
        rows = s.execute(
            select(Expert.uid, Expert.replica, Expert.checkpoint_step, Expert.checkpoint_key).where(
                Expert.mixture_id == mixture_id,
                Expert.uid.in_({e.uid for e in held}),
                Expert.checkpoint_key.is_not(None),
            )
        ).all()
    else:
        return []
    checkpoints: dict[str, list[tuple[int, int, str]]] = {}  # uid -> (step, replica, key)
    for uid, replica, step, key in rows:
        if key is not None:
            checkpoints.setdefault(uid, []).append((step, replica, key))
    leases = []
    for e in held:
        every = sorted(checkpoints.get(e.uid, []), reverse=True)
        others = [c for c in every if c[1] != e.replica]
        newest, peer = (every[0] if every else None), (others[0] if others else None)
        leases.append(
            Lease(
                e.uid,
                e.replica,
                until,
                None if newest is None else newest[2],
                0 if newest is None else newest[0],
                None if peer is None else peer[2],
                0 if peer is None else peer[0],
                e.checkpoint_key,
                e.checkpoint_step,
            )
        )
    return leases


def expire_leases(db: sessionmaker[Session], now: datetime) -> int:
    """Free every expert whose lease ended before `now`, so that trainers stop calling its host and
    another host may lease it; how many. For the transitioner."""
    with db.begin() as s:
        ended = s.scalars(
            select(Expert).where(Expert.host_id.is_not(None), Expert.lease_expires_at <= now).order_by(Expert.id)
        ).all()
        mixtures: dict[int, Mixture] = {}
        for expert in ended:
            if expert.mixture_id not in mixtures:
                mixtures[expert.mixture_id] = locked_mixture(s, expert.mixture_id)
            _route(mixtures[expert.mixture_id], expert, None, None)
            expert.lease_expires_at = None
        return len(ended)


def _leased_expert(s: Session, host_id: int, mixture_id: int, uid: str, now: datetime) -> tuple[Expert, int]:
    """The replica of expert `uid` that the host leases (it holds one replica of an expert at most), and
    how many replicas the expert has."""
    replicas = s.scalars(
        select(Expert).where(Expert.mixture_id == mixture_id, Expert.uid == uid).order_by(Expert.replica)
    ).all()
    if not replicas:
        raise NotFound(f"mixture {mixture_id} has no expert {uid[:40]!r}")
    for expert in replicas:
        if expert.host_id == host_id and expert.lease_expires_at is not None and expert.lease_expires_at > now:
            return expert, len(replicas)
    raise Refusal(f"expert {uid} is not leased to this host", RefusalKind.forbidden)


def check_lease(db: sessionmaker[Session], host_id: int, mixture_id: int, uid: str, now: datetime) -> Lease:
    """The host's lease of the expert (with the checkpoints of its replicas); NotFound for no such
    expert, forbidden when the host leases none of its replicas."""
    with db.begin() as s:
        e, replicas = _leased_expert(s, host_id, mixture_id, uid, now)
        assert e.lease_expires_at is not None
        return _leases(s, mixture_id, [e], e.lease_expires_at, replicas)[0]


def record_checkpoint(
    db: sessionmaker[Session], host_id: int, mixture_id: int, uid: str, step: int, key: str, now: datetime
) -> str | None:
    """Record `key` as the checkpoint, after `step` of its steps, of the replica of the expert that the
    host leases; the key it replaces (for the caller to delete), if any. A checkpoint no newer than the
    one recorded is refused (conflict): a host restored from it has nothing newer to say."""
    with db.begin() as s:
        expert, _ = _leased_expert(s, host_id, mixture_id, uid, now)
        if expert.checkpoint_key is not None and step <= expert.checkpoint_step:
            raise Refusal(
                f"expert {uid} has a checkpoint of step {expert.checkpoint_step} already; {step} is not newer"
            )
        replaced = expert.checkpoint_key
        expert.checkpoint_key, expert.checkpoint_step, expert.checkpoint_at = key, step, now
        return replaced


def free_hosts_experts(s: Session, mixture: Mixture, host_id: int) -> None:
    """Free every expert of the mixture that `host_id` holds (its host was quarantined), in `s`."""
    for expert in s.scalars(select(Expert).where(Expert.mixture_id == mixture.id, Expert.host_id == host_id)):
        _route(mixture, expert, None, None)
        expert.lease_expires_at = None


def routing_changes(db: sessionmaker[Session], mixture_id: int, since: int) -> tuple[int, list[Route]]:
    """The mixture's routing table as (version, the routes of the experts that changed after `since`):
    since 0, every expert that has had a host. A trainer applies the routes in order and asks again
    from the version."""
    with db.begin() as s:
        mixture = s.get(Mixture, mixture_id)
        if mixture is None:
            raise NotFound(f"mixture {mixture_id} does not exist")
        changed = s.execute(
            select(Expert.uid, Expert.replica, Expert.url)
            .where(Expert.mixture_id == mixture_id, Expert.route_version > since)
            .order_by(Expert.route_version)
        ).all()
        return mixture.route_version, [Route(uid, replica, url) for uid, replica, url in changed]


# Reads of an expert's newest checkpoint key, by a reader that finds each checkpoint it read the key of
# gone (a host's newer checkpoint deletes the one before it) by the time it reads its bytes.
KEY_READS = 3


def checkpoint_keys(db: sessionmaker[Session], mixture_id: int) -> dict[str, str]:
    """Where each expert of the mixture that has a checkpoint keeps its newest one (of any replica):
    uid -> object key."""
    with db.begin() as s:
        rows = s.execute(
            select(Expert.uid, Expert.checkpoint_key)
            .where(Expert.mixture_id == mixture_id, Expert.checkpoint_key.is_not(None))
            .order_by(Expert.checkpoint_step, Expert.replica.desc())
        ).all()
        return {uid: key for uid, key in rows if key is not None}  # the newest last, so it stays
