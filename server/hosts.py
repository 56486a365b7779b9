"""Host registration and authentication. Tokens are random; only their sha256 is stored."""

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.schemas import HostRegister, HostRegistered
from server.models import Host


class NotAuthorized(Exception):
    pass


def hash_token(token: str) -> str:
    # Tokens carry 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(token.encode()).hexdigest()


def register_host(db: sessionmaker[Session], req: HostRegister, join_token: str) -> HostRegistered:
    if not hmac.compare_digest(req.join_token.encode(), join_token.encode()):
        raise NotAuthorized("invalid join token")
    token = secrets.token_urlsafe(32)
    with db.begin() as s:
        r = req.resources
        host = Host(name=req.name, token_hash=hash_token(token), cpus=r.cpus, ram_bytes=r.ram_bytes, gpu=r.gpu,
                    device=r.device)
        s.add(host)
        s.flush()
        return HostRegistered(host_id=host.id, host_token=token)


def authenticate_host(db: sessionmaker[Session], token: str) -> int:
    with db.begin() as s:
        row = s.execute(select(Host.id, Host.revoked).where(Host.token_hash == hash_token(token))).first()
    if row is None or row.revoked:
        raise NotAuthorized("unknown or revoked host token")
    return row.id
