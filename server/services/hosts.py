"""Host registration and authentication. Tokens are random; only their sha256 is stored."""

import hashlib
import hmac
import secrets

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.core.addresses import canonical_address, network_prefix
from crowdtrain.core.refusals import NotFound, Refusal, RefusalKind
from crowdtrain.core.schemas import (
    HostPublic,
    HostRegister,
    HostRegistered,
    JoinTokenCreated,
    JoinTokenPublic,
)
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger import assignments, reputation
from crowdtrain.server.ledger.models import Host, JoinToken


class NotAuthorized(Refusal):
    """A token that does not admit its bearer (a join token: forbidden; a host token: unauthenticated)."""

    kind = RefusalKind.forbidden


def hash_token(token: str) -> str:
    # Tokens carry 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(token.encode()).hexdigest()


def _join_token_id(s: Session, token: str, bootstrap_token: str) -> int | None:
    """The id of the active join token `token` (None for the bootstrap token from the settings)."""
    if bootstrap_token and hmac.compare_digest(token.encode(), bootstrap_token.encode()):
        return None
    row = s.execute(select(JoinToken.id, JoinToken.revoked).where(JoinToken.token_hash == hash_token(token))).first()
    if row is None or row.revoked:
        raise NotAuthorized("invalid or revoked join token")
    return row.id


def register_host(
    db: sessionmaker[Session], req: HostRegister, bootstrap_token: str, address: str = ""
) -> HostRegistered:
    """Register a host that called from `address` (the peer address the scheduler saw, "" if unknown)."""
    token = secrets.token_urlsafe(32)
    with db.begin() as s:
        join_id = _join_token_id(s, req.join_token, bootstrap_token)
        r = req.resources
        host = Host(
            name=req.name,
            token_hash=hash_token(token),
            cpus=r.cpus,
            ram_bytes=r.ram_bytes,
            gpu=r.gpu,
            device=r.device,
            frameworks=",".join(r.frameworks),
            join_token_id=join_id,
            account=req.account,
            address=canonical_address(address),
            network=network_prefix(address),
        )
        s.add(host)
        if join_id is not None:
            s.get_one(JoinToken, join_id).hosts_registered += 1
        s.flush()
        return HostRegistered(host_id=host.id, host_token=token)


def authenticate_host(db: sessionmaker[Session], token: str) -> int:
    with db.begin() as s:
        row = s.execute(select(Host.id, Host.revoked).where(Host.token_hash == hash_token(token))).first()
    if row is None or row.revoked:
        raise NotAuthorized("unknown or revoked host token", RefusalKind.unauthenticated)
    return row.id


def create_join_token(db: sessionmaker[Session], label: str) -> JoinTokenCreated:
    """Issue a join token; the token itself is shown only in this answer."""
    token = secrets.token_urlsafe(32)
    with db.begin() as s:
        row = JoinToken(label=label, token_hash=hash_token(token))
        s.add(row)
        s.flush()
        return JoinTokenCreated(id=row.id, label=label, token=token)


def list_join_tokens(db: sessionmaker[Session]) -> list[JoinTokenPublic]:
    with db.begin() as s:
        return [
            JoinTokenPublic(
                id=t.id, label=t.label, created_at=t.created_at, revoked=t.revoked, hosts_registered=t.hosts_registered
            )
            for t in s.scalars(select(JoinToken).order_by(JoinToken.id))
        ]


def revoke_join_token(db: sessionmaker[Session], token_id: int) -> JoinTokenPublic:
    """No new host can register with it; hosts already registered keep working."""
    with db.begin() as s:
        t = s.get(JoinToken, token_id)
        if t is None:
            raise NotFound(f"join token {token_id} does not exist")
        t.revoked = True
        return JoinTokenPublic(
            id=t.id, label=t.label, created_at=t.created_at, revoked=True, hosts_registered=t.hosts_registered
        )


def list_hosts(db: sessionmaker[Session]) -> list[HostPublic]:
    with db.begin() as s:
        return [HostPublic.model_validate(h, from_attributes=True) for h in s.scalars(select(Host).order_by(Host.id))]


def revoke_host(db: sessionmaker[Session], storage: Storage, r: redis.Redis, host_id: int) -> HostPublic:
    """Refuse the host from now on and give its running assignments back to the pool at once; the
    epochs of workunits that failed for good are closed (crowdtrain.server.ledger.assignments.revoke_host).
    NotFound if there is no such host."""
    return assignments.revoke_host(db, storage, r, host_id, evaluate)


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
