"""FastAPI dependencies: settings, database, storage, Redis, and the two kinds of caller (failed
authentication is throttled per client address: crowdtrain.server.services.throttle).

Refusals raised here (NotAuthorized, Throttled) are answered by the app's one refusal handler
(crowdtrain.server.api.boundary)."""

import hmac
import threading
from collections.abc import AsyncIterator, Callable
from functools import wraps
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.refusals import RefusalKind
from crowdtrain.core.settings import Settings
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.server.ledger import paramstore
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.services import sessions
from crowdtrain.server.services.hosts import NotAuthorized, authenticate_host, hash_token
from crowdtrain.server.services.throttle import FailureBudget


async def app_settings(request: Request) -> Settings:
    """The settings the app was built with (crowdtrain.server.api.app.create_app)."""
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(app_settings)]


def cache_once(make: Callable) -> Callable:
    """Memoise a client factory under a lock, so concurrent first requests share one client."""
    made: dict = {}
    lock = threading.Lock()

    @wraps(make)
    def get(*args):
        with lock:
            if args not in made:
                made[args] = make(*args)
            return made[args]

    return get


# The dependencies below only look things up: they are coroutines, so that FastAPI does not send
# each of them to its thread pool (a hop of its own per dependency and request).


async def get_db(settings: SettingsDep) -> sessionmaker[Session]:
    return session_factory(settings.resolved_database_url)


@cache_once
def _storage(url: str, endpoint: str | None, public_endpoint: str | None) -> Storage:
    return open_storage(url, endpoint, public_endpoint)


async def get_storage(settings: SettingsDep) -> Storage:
    return _storage(settings.resolved_storage_url, settings.s3_endpoint_url, settings.s3_public_endpoint_url)


@cache_once
def _redis(url: str) -> redis.Redis:
    return paramstore.connect(url)


async def get_redis(settings: SettingsDep) -> redis.Redis:
    return _redis(settings.redis_url)


DbDep = Annotated[sessionmaker[Session], Depends(get_db)]
StorageDep = Annotated[Storage, Depends(get_storage)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
_bearer = HTTPBearer(auto_error=False)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"})


async def failure_budget(request: Request, r: RedisDep, settings: SettingsDep) -> AsyncIterator[FailureBudget]:
    """The caller's address's budget of failed authentications: refused at once (Throttled) if it is
    used up, and spent by every NotAuthorized raised while the request is answered."""
    address = request.client.host if request.client else "unknown"
    budget = FailureBudget(r, address, settings.auth_failures_per_minute)
    budget.check()
    try:
        yield budget
    except NotAuthorized:
        budget.spend()
        raise


FailureBudgetDep = Annotated[FailureBudget, Depends(failure_budget)]


def current_host(creds: BearerDep, db: DbDep, _: FailureBudgetDep) -> int:
    """The id of the host whose token the request carries (401 if none, or not a live host's)."""
    if creds is None:
        raise _unauthorized("missing host token (Authorization: Bearer ...)")
    return authenticate_host(db, creds.credentials)


def require_admin(creds: BearerDep, settings: SettingsDep, _: FailureBudgetDep) -> None:
    """Admit the operator's token only (401 otherwise)."""
    if creds is None:
        raise _unauthorized("admin token required")
    if not settings.admin_token or not hmac.compare_digest(creds.credentials.encode(), settings.admin_token.encode()):
        raise NotAuthorized("admin token required", RefusalKind.unauthenticated)


class _KnownHostTokens:
    """Hashes of host tokens this process has seen admitted. Only a gate before the request's body is
    read, so that a caller with a wrong token learns nothing but 401: the route authenticates the token
    again in its own transaction, so a host revoked since is refused there all the same."""

    LIMIT = 500_000

    def __init__(self) -> None:
        self._hashes: set[str] = set()

    def __contains__(self, token_hash: str) -> bool:
        return token_hash in self._hashes

    def add(self, token_hash: str) -> None:
        if len(self._hashes) >= self.LIMIT:
            self._hashes.clear()
        self._hashes.add(token_hash)


_known_host_tokens = _KnownHostTokens()


async def host_token(creds: BearerDep, db: DbDep, _: FailureBudgetDep) -> str:
    """The host token the request carries (401 if none, or not a live host's), for a route that
    authenticates it again inside its own transaction (crowdtrain.server.services.dispatch.serve_work).
    A token first seen by this process is looked up at once (one thread-pool hop); after that, the
    route's transaction is the only lookup. A NotAuthorized raised here or there spends the failure
    budget like any other."""
    if creds is None:
        raise _unauthorized("missing host token (Authorization: Bearer ...)")
    token_hash = hash_token(creds.credentials)
    if token_hash not in _known_host_tokens:
        await run_in_threadpool(authenticate_host, db, creds.credentials)
        _known_host_tokens.add(token_hash)
    return creds.credentials


HostDep = Annotated[int, Depends(current_host)]
HostTokenDep = Annotated[str, Depends(host_token)]
AdminDep = Depends(require_admin)


SESSION_COOKIE = "crowdtrain_session"
READ_ONLY_METHODS = frozenset({"GET", "HEAD"})


def has_session(request: Request, settings: SettingsDep) -> bool:
    """Whether the request carries a live dashboard session cookie (crowdtrain.server.services.sessions).

    Only read-only requests may be admitted by the cookie, so that no other site can make a browser
    change anything with it (CSRF); everything that changes state takes the bearer token alone. A
    forged cookie is not a guess at a secret (it is an HMAC of 256 bits), so it spends no failure budget:
    a session ended by a new admin token would otherwise throttle the operator's open pages."""
    if request.method not in READ_ONLY_METHODS:
        return False
    return sessions.is_valid(settings.admin_token, request.cookies.get(SESSION_COOKIE))


def require_session(logged_in: Annotated[bool, Depends(has_session)]) -> None:
    """Admit a read-only request with a dashboard session (401 otherwise)."""
    if not logged_in:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "dashboard login required (POST /dashboard/login)")


SessionDep = Annotated[bool, Depends(has_session)]
RequireSession = Depends(require_session)
