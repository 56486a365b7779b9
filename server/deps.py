"""FastAPI dependencies: settings, database, storage, Redis, and the two kinds of caller (failed
authentication is throttled per client address: server.throttle)."""

import hmac
import threading
from collections.abc import Callable
from functools import wraps
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from assimilator import paramstore
from crowdtrain.settings import Settings, get_settings
from crowdtrain.storage import Storage, open_storage
from server.db import session_factory
from server.hosts import NotAuthorized, authenticate_host
from server.throttle import FailureBudget, Throttled

SettingsDep = Annotated[Settings, Depends(get_settings)]


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


def get_db(settings: SettingsDep) -> sessionmaker[Session]:
    return session_factory(settings.resolved_database_url)


@cache_once
def _storage(url: str, endpoint: str | None, public_endpoint: str | None) -> Storage:
    return open_storage(url, endpoint, public_endpoint)


def get_storage(settings: SettingsDep) -> Storage:
    return _storage(settings.resolved_storage_url, settings.s3_endpoint_url, settings.s3_public_endpoint_url)


@cache_once
def _redis(url: str) -> redis.Redis:
    return paramstore.connect(url)


def get_redis(settings: SettingsDep) -> redis.Redis:
    return _redis(settings.redis_url)


DbDep = Annotated[sessionmaker[Session], Depends(get_db)]
StorageDep = Annotated[Storage, Depends(get_storage)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
_bearer = HTTPBearer(auto_error=False)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"})


def failure_budget(request: Request, r: RedisDep, settings: SettingsDep) -> FailureBudget:
    """The caller's address's budget of failed authentications; answers 429 at once if it is used up."""
    address = request.client.host if request.client else "unknown"
    budget = FailureBudget(r, address, settings.auth_failures_per_minute)
    try:
        budget.check()
    except Throttled as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc),
                            headers={"Retry-After": str(exc.retry_after)}) from None
    return budget


FailureBudgetDep = Annotated[FailureBudget, Depends(failure_budget)]


def current_host(creds: BearerDep, db: DbDep, budget: FailureBudgetDep) -> int:
    if creds is None:
        raise _unauthorized("missing host token (Authorization: Bearer ...)")
    try:
        return authenticate_host(db, creds.credentials)
    except NotAuthorized as exc:
        budget.spend()
        raise _unauthorized(str(exc)) from None


def require_admin(creds: BearerDep, settings: SettingsDep, budget: FailureBudgetDep) -> None:
    if creds is None:
        raise _unauthorized("admin token required")
    if not settings.admin_token or not hmac.compare_digest(creds.credentials.encode(), settings.admin_token.encode()):
        budget.spend()
        raise _unauthorized("admin token required")


HostDep = Annotated[int, Depends(current_host)]
AdminDep = Depends(require_admin)
