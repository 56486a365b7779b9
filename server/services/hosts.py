"""Host registration and authentication. Tokens are random; only their sha256 is stored."""

import hashlib
import hmac
import secrets
from datetime import datetime

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.addresses import canonical_address, network_prefix
from crowdtrain.core.refusals import NotFound, Refusal, RefusalKind
from crowdtrain.core.schemas import (
    HostPublic,
    HostRegister,
    HostRegistered,
    JoinTokenCreate,
    JoinTokenCreated,
    JoinTokenPublic,
)
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger import assignments, reputation
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.ledger.models import Host, JoinToken, utcnow
from crowdtrain.server.services import registration
from crowdtrain.server.services.registration import DEFAULT_POLICY, RegistrationPolicy


class NotAuthorized(Refusal):
    """A token that does not admit its bearer (a join token: forbidden; a host token: unauthenticated)."""

    kind = RefusalKind.forbidden


def hash_token(token: str) -> str:
    # Tokens carry 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(token.encode()).hexdigest()


def _join_token(s: Session, token: str, bootstrap_token: str) -> JoinToken | None:
    """The active join token `token`, its row locked (None for the bootstrap token from the settings)."""
    if bootstrap_token and hmac.compare_digest(token.encode(), bootstrap_token.encode()):
        return None
    row = s.scalars(select(JoinToken).where(JoinToken.token_hash == hash_token(token)).with_for_update()).first()
    if row is None or row.revoked:
        raise NotAuthorized("invalid or revoked join token")
    return row


def register_host(
    db: sessionmaker[Session],
    req: HostRegister,
    bootstrap_token: str,
    address: str = "",
    policy: RegistrationPolicy = DEFAULT_POLICY,
    now: datetime | None = None,
) -> HostRegistered:
    """Register a host that called from `address` (the peer address the scheduler saw, "" if unknown) at `now`
    (default: the clock): refused (RegistrationLimited) over the policy's limits, storing nothing. The host is
    under its join token's account if the token has one (crowdtrain.server.services.registration), and starts
    quarantined if its account or network has a host in quarantine."""
    now = now or utcnow()
    token = secrets.token_urlsafe(32)
    with db.begin() as s:
        join = _join_token(s, req.join_token, bootstrap_token)
        network = network_prefix(address)
        registration.admit(s, policy, join, network, now)
        r = req.resources
        host = Host(
            name=req.name,
            token_hash=hash_token(token),
            cpus=r.cpus,
            ram_bytes=r.ram_bytes,
            gpu=r.gpu,
            device=r.device,
            frameworks=",".join(r.frameworks),
            join_token_id=join.id if join is not None else None,
            account=registration.host_account(join.account if join is not None else "", req.account),
            address=canonical_address(address),
            network=network,
            created_at=now,
            last_seen=now,
        )
        registration.inherit_quarantine(s, policy, host, now)
        s.add(host)
        if join is not None:
            join.hosts_registered += 1
        s.flush()
        return HostRegistered(host_id=host.id, host_token=token)


def authenticate_host(db: sessionmaker[Session], token: str) -> int:
    with db.begin() as s:
        return host_of_token(s, token)


def host_of_token(s: Session, token: str) -> int:
    """The id of the live host whose bearer `token` this is, read in the caller's transaction `s`
    (NotAuthorized if none, or revoked)."""
    row = s.execute(select(Host.id, Host.revoked).where(Host.token_hash == hash_token(token))).first()
    if row is None or row.revoked:
        raise NotAuthorized("unknown or revoked host token", RefusalKind.unauthenticated)
    return int(row.id)


def create_join_token(db: sessionmaker[Session], req: JoinTokenCreate) -> JoinTokenCreated:
    """Issue a join token (for one volunteer account, with its own registration limit, if `req` says so); the
    token itself is shown only in this answer."""
    token = secrets.token_urlsafe(32)
    with db.begin() as s:
        row = JoinToken(
            label=req.label,
            token_hash=hash_token(token),
            account=req.account,
            registrations_per_hour=req.registrations_per_hour,
        )
        s.add(row)
        s.flush()
        return JoinTokenCreated(
            id=row.id,
            label=row.label,
            account=row.account,
            registrations_per_hour=row.registrations_per_hour,
            token=token,
        )


def list_join_tokens(db: sessionmaker[Session]) -> list[JoinTokenPublic]:
    with db.begin() as s:
        return [
            JoinTokenPublic.model_validate(t, from_attributes=True)
            for t in s.scalars(select(JoinToken).order_by(JoinToken.id))
        ]


def revoke_join_token(db: sessionmaker[Session], token_id: int) -> JoinTokenPublic:
    """No new host can register with it; hosts already registered keep working."""
    with db.begin() as s:
        t = s.get(JoinToken, token_id)
        if t is None:
            raise NotFound(f"join token {token_id} does not exist")
        t.revoked = True
        s.flush()
        return JoinTokenPublic.model_validate(t, from_attributes=True)


def list_hosts(db: sessionmaker[Session]) -> list[HostPublic]:
    with db.begin() as s:
        return [HostPublic.model_validate(h, from_attributes=True) for h in s.scalars(select(Host).order_by(Host.id))]


def revoke_host(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, evaluator: Evaluator, host_id: int
) -> HostPublic:
    """Refuse the host from now on and give its running assignments back to the pool at once; the
    epochs of workunits that failed for good are closed (crowdtrain.server.ledger.assignments.revoke_host).
    NotFound if there is no such host."""
    return assignments.revoke_host(db, storage, r, host_id, evaluator)


def release_host(db: sessionmaker[Session], host_id: int) -> HostPublic:
    """End the host's quarantine now (NotFound if there is no such host); it works on probation, its runs of
    valid and refused results starting over."""
    with db.begin() as s:
        host = s.get(Host, host_id, with_for_update=True)
        if host is None:
            raise NotFound(f"host {host_id} does not exist")
        reputation.release(host)
        s.flush()
        return HostPublic.model_validate(host, from_attributes=True)
