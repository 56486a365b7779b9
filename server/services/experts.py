"""Expert-parallel training's registry (the ledger's crowdtrain.server.ledger.experts) with its I/O:
the connect-back probe of a host that asks for experts, the experts' checkpoints in object storage,
and the trainers' reports of their calls. A checkpoint is written before it is recorded and deleted
when it is replaced; a crash in between leaves an unrecorded object behind, never a record without
its object."""

import contextlib
import logging
import secrets
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.refusals import Refusal, RefusalKind
from crowdtrain.core.schemas_experts import (
    CallReport,
    CallsRecorded,
    CheckpointStored,
    ExpertOut,
    LeaseOut,
    LeaseRequest,
    Leases,
    MixtureCreate,
    MixtureCreated,
    MixtureOut,
    RouteOut,
    RoutingTable,
)
from crowdtrain.core.storage import ObjectNotFound, Storage
from crowdtrain.core.tensors import TensorFormatError, views
from crowdtrain.core.validationspec import validation_of
from crowdtrain.server.ledger import expert_calls
from crowdtrain.server.ledger import experts as ledger

log = logging.getLogger(__name__)
PROBE_SECONDS = 3.0
CHECKPOINT_TENSORS = 64  # a feed-forward expert's checkpoint holds 13; room for larger experts to come


def _naive(now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC).replace(tzinfo=None)


def connect_back(url: str) -> bool:
    """Whether the host at `url` answers its health check: hosts that cannot accept connections
    (behind NAT) train as trainers instead. No redirect is followed."""
    try:
        return httpx.get(f"{url}/v1/health", timeout=PROBE_SECONDS, follow_redirects=False).status_code == 200
    except httpx.HTTPError:
        return False


def create_mixture(db: sessionmaker[Session], req: MixtureCreate) -> MixtureCreated:
    return MixtureCreated(mixture_id=ledger.create_mixture(db, req.name, req.layout))


def lease(
    db: sessionmaker[Session],
    host_id: int,
    mixture_id: int,
    req: LeaseRequest,
    now: float,
    probe: Callable[[str], bool] = connect_back,
) -> Leases:
    """The host's call (its heartbeat): its leases renewed and, if it has room and answers at its URL,
    more experts leased to it."""
    at = _naive(now)
    renewal = ledger.renew_and_lease(db, host_id, mixture_id, req.url, req.capacity, at, grant=False)
    # The probe (a connection to the host, and its answer) only when there is an expert to lease or the
    # host asks for some and holds none: a host with room calls every heartbeat, and probing it each
    # time while every expert was leased cost the scheduler a third of its CPU in a mixture's training.
    if renewal.more or (req.capacity > 0 and not renewal.leases):
        if probe(req.url):
            if renewal.more:
                renewal = ledger.renew_and_lease(db, host_id, mixture_id, req.url, req.capacity, at, grant=True)
        elif not renewal.leases:
            raise Refusal(
                f"the scheduler cannot reach {req.url}/v1/health: an expert host must accept connections "
                "at the URL it gives (train as a trainer instead)",
                RefusalKind.unacceptable,
            )
    layout = renewal.layout
    return Leases(
        mixture_id=mixture_id,
        layout=layout,
        heartbeat_seconds=layout.heartbeat_seconds,
        leases=[
            LeaseOut(
                uid=h.uid,
                replica=h.replica,
                expires_in=(h.expires_at - at).total_seconds(),
                checkpoint_step=h.checkpoint_step,
                has_checkpoint=h.checkpoint_key is not None,
                peer_step=h.peer_step,
            )
            for h in renewal.leases
        ],
    )


def store_checkpoint(
    db: sessionmaker[Session],
    storage: Storage,
    host_id: int,
    mixture_id: int,
    uid: str,
    step: int,
    body: bytes,
    now: float,
) -> CheckpointStored:
    """Keep the expert's checkpoint after `step` of its steps, uploaded by the host that leases it:
    safetensors of its weights and optimizer state (the host that restores it checks them against the
    expert; here, that they are tensors at all, within the layout's size)."""
    layout = ledger.mixture_layout(db, mixture_id)
    at = _naive(now)
    held = ledger.check_lease(db, host_id, mixture_id, uid, at)
    if held.own_key is not None and step <= held.own_step:
        raise Refusal(f"expert {uid} has a checkpoint of step {held.own_step} already; {step} is not newer")
    if len(body) > layout.checkpoint_limit():
        raise Refusal(
            f"a checkpoint of this layout is at most {layout.checkpoint_limit()} bytes", RefusalKind.unacceptable
        )
    try:
        views(body, max_header_bytes=65_536, max_tensors=CHECKPOINT_TENSORS)
    except TensorFormatError as exc:
        raise Refusal(f"checkpoint: {exc}", RefusalKind.malformed) from None
    key = keys.expert_checkpoint_key(mixture_id, uid, step, secrets.token_hex(8))
    storage.put(key, body)
    try:
        replaced = ledger.record_checkpoint(db, host_id, mixture_id, uid, step, key, at)
    except Refusal:
        storage.delete(key)
        raise
    if replaced is not None:
        storage.delete(replaced)
    return CheckpointStored(uid=uid, step=step)


def checkpoint(
    db: sessionmaker[Session], storage: Storage, host_id: int, mixture_id: int, uid: str, now: float, peer: bool = False
) -> bytes:
    """For the host that leases a replica of the expert: the newest checkpoint of any of its replicas
    (to restore it), or with `peer` of its other replicas (to average with); NotFound with none."""
    for _ in range(ledger.KEY_READS):  # a checkpoint gone when read was replaced by a newer one: read its key again
        held = ledger.check_lease(db, host_id, mixture_id, uid, _naive(now))
        key = held.peer_key if peer else held.checkpoint_key
        if key is None:
            which = "no other replica" if peer else "no replica"
            raise Refusal(f"expert {uid}: {which} has a checkpoint yet", RefusalKind.not_found)
        with contextlib.suppress(ObjectNotFound):
            return storage.get(key)
    raise Refusal(f"expert {uid}: its checkpoint was replaced as it was read, again and again", RefusalKind.conflict)


def routing(db: sessionmaker[Session], mixture_id: int, since: int) -> RoutingTable:
    version, routes = ledger.routing_changes(db, mixture_id, since)
    return RoutingTable(version=version, routes=[RouteOut(uid=r.uid, replica=r.replica, url=r.url) for r in routes])


def record_calls(
    db: sessionmaker[Session], host_id: int, mixture_id: int, report: CallReport, now: float
) -> CallsRecorded:
    """A trainer's report of its calls to the mixture's experts (crowdtrain.server.ledger.expert_calls.record_calls):
    the experts' counts, the hosts' credit for what they answered and charges for what was refused."""
    counts = [expert_calls.CallCounts(**c.model_dump()) for c in report.experts]
    counted, ignored = expert_calls.record_calls(
        db, host_id, mixture_id, counts, report.seconds, _naive(now), validation_of({}).quarantine_after
    )
    refused = sum(c.refused for c in report.experts)
    if refused:
        log.warning("mixture %s: host %s reports %d expert answers refused", mixture_id, host_id, refused)
    disagreed = sum(c.disagreed for c in report.experts)
    if disagreed:
        log.warning("mixture %s: host %s reports %d replica answers that disagreed", mixture_id, host_id, disagreed)
    return CallsRecorded(counted=counted, ignored=ignored)


def expire_leases(db: sessionmaker[Session], now: float) -> int:
    """The transitioner's sweep: free the experts whose lease ended (crowdtrain.server.ledger.experts)."""
    freed = ledger.expire_leases(db, _naive(now))
    if freed:
        log.info("%d expert leases ended: their experts are free to lease", freed)
    return freed


def mixture_status(db: sessionmaker[Session], mixture_id: int) -> MixtureOut:
    mixture, rows = expert_calls.mixture_experts(db, mixture_id)
    return MixtureOut(
        mixture_id=mixture.id,
        name=mixture.name,
        status=mixture.status,
        layout=ExpertLayout.model_validate(mixture.layout),
        route_version=mixture.route_version,
        served=sum(r.url is not None for r in rows),
        experts=[
            ExpertOut(
                uid=r.uid,
                replica=r.replica,
                host_id=r.host_id,
                url=r.url,
                lease_expires_at=r.lease_expires_at,
                leases=r.leases,
                checkpoint_step=r.checkpoint_step,
                checkpoint_at=r.checkpoint_at,
                answered=r.answered,
                failed=r.failed,
                late=r.late,
                refused=r.refused,
                compared=r.compared,
                disagreed=r.disagreed,
                answers_per_s=r.answered / r.reported_seconds if r.reported_seconds > 0 else None,
            )
            for r in rows
        ],
    )
