"""FastAPI dependencies: settings, database, storage, Redis, the evaluator, the merge queue, the clock,
and the two kinds of caller (failed authentication is throttled per client address:
crowdtrain.server.services.throttle).

Refusals raised here (NotAuthorized, Throttled) are answered by the app's one refusal handler
(crowdtrain.server.api.boundary)."""

import hmac
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property, wraps
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.evaluate import FrameworkEvaluator
from crowdtrain.assimilator.expert_weights import ExpertCheckpoints
from crowdtrain.assimilator.worker.celery_app import enqueue_merge
from crowdtrain.core.refusals import RefusalKind
from crowdtrain.core.settings import Settings
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.paramstore import store
from crowdtrain.server.services import sessions
from crowdtrain.server.services.hosts import NotAuthorized, authenticate_host
from crowdtrain.server.services.results import MergeQueue
from crowdtrain.server.services.throttle import FailureBudget


async def app_settings(request: Request) -> Settings:
    """The settings the app was built with (crowdtrain.server.api.app.create_app)."""
    return _clients(request).settings


SettingsDep = Annotated[Settings, Depends(app_settings)]


def clock() -> float:
    """The current Unix time, as the routes that hand it to the services read it: a test sets its own
    time with `app.dependency_overrides[clock]`, instead of sleeping until a real window passes."""
    return time.time()


NowDep = Annotated[float, Depends(clock)]


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


@cache_once
def _storage(url: str, endpoint: str | None, public_endpoint: str | None) -> Storage:
    return open_storage(url, endpoint, public_endpoint)


@cache_once
def _redis(url: str) -> redis.Redis:
    return store.connect(url)


class Clients:
    """The database, object storage and Redis clients of an app's settings, made on first use and
    kept: resolving the settings' URLs on every request cost more than the lookups it served; and the
    app's one evaluator (crowdtrain.server.ledger.job_end.Evaluator), which scores the model a job
    exports when a host's request ends it, and a DeDLOC step's state; and its merge queue (the
    parameter servers' Celery queue unless given), where an accepted result's merge is queued."""

    def __init__(self, settings: Settings, evaluator: Evaluator | None = None, merge_queue: MergeQueue | None = None):
        self.settings = settings
        self._evaluator = evaluator
        self.merge_queue: MergeQueue = merge_queue or enqueue_merge

    @cached_property
    def db(self) -> sessionmaker[Session]:
        return session_factory(self.settings.resolved_database_url)

    @cached_property
    def evaluator(self) -> Evaluator:
        # A mode moe job's model is evaluated with its experts' last checkpoints.
        return self._evaluator or FrameworkEvaluator(ExpertCheckpoints(self.db, self.storage))

    @cached_property
    def storage(self) -> Storage:
        s = self.settings
        return _storage(s.resolved_storage_url, s.s3_endpoint_url, s.s3_public_endpoint_url)

    @cached_property
    def redis(self) -> redis.Redis:
        return _redis(self.settings.redis_url)


def _clients(request: Request) -> Clients:
    clients: Clients = request.app.state.clients
    return clients


# The dependencies below only look things up: they are coroutines, so that FastAPI does not send
# each of them to its thread pool (a hop of its own per dependency and request).


async def get_db(request: Request) -> sessionmaker[Session]:
    return _clients(request).db


async def get_storage(request: Request) -> Storage:
    return _clients(request).storage


async def get_redis(request: Request) -> redis.Redis:
    return _clients(request).redis


async def get_evaluator(request: Request) -> Evaluator:
    return _clients(request).evaluator


async def get_merge_queue(request: Request) -> MergeQueue:
    return _clients(request).merge_queue


DbDep = Annotated[sessionmaker[Session], Depends(get_db)]
StorageDep = Annotated[Storage, Depends(get_storage)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
EvaluatorDep = Annotated[Evaluator, Depends(get_evaluator)]
MergeQueueDep = Annotated[MergeQueue, Depends(get_merge_queue)]
_bearer = HTTPBearer(auto_error=False)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"})


async def failure_budget(request: Request, r: RedisDep, settings: SettingsDep) -> AsyncIterator[FailureBudget]:
    """The caller's address's budget of failed authentications, spent by every NotAuthorized raised
    while the request is answered; once it is used up, such a failure is answered 429 (Throttled).
    A request whose credential is right is never refused by it."""
    address = request.client.host if request.client else "unknown"
    budget = FailureBudget(r, address, settings.auth_failures_per_minute)
    try:
        yield budget
    except NotAuthorized:
        budget.fail()
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


@dataclass(frozen=True)
class HostCall:
    """What a host's hot route needs, gathered from the request without FastAPI's dependency
    solving (`host_call`, for a crowdtrain.server.api.lean.LeanRoute): on the work route that
    machinery cost more CPU than the request's SQL."""

    token: str
    settings: Settings
    db: sessionmaker[Session]
    storage: Storage
    r: redis.Redis
    budget: FailureBudget


def host_call(request: Request) -> HostCall:
    """The host token the request carries (401 if none), for a route that authenticates it inside its
    own transaction and checks and spends the address's failure budget itself (`HostCall.budget`,
    crowdtrain.server.services.throttle.FailureBudget.admit)."""
    scheme, token = get_authorization_scheme_param(request.headers.get("authorization"))
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("missing host token (Authorization: Bearer ...)")
    c = _clients(request)
    address = request.client.host if request.client else "unknown"
    budget = FailureBudget(c.redis, address, c.settings.auth_failures_per_minute)
    return HostCall(token, c.settings, c.db, c.storage, c.redis, budget)


async def serve_host_call(request: Request, serve: Callable[[HostCall], bytes]) -> Response:
    """A lean host route's answer: `serve` (which authenticates the token in its own transaction and
    returns the reply's JSON bytes) runs in the thread pool, one hop for the whole request; a wrong
    token consults the address's failure budget (429 once it is used up) and spends it before its 401
    goes out."""
    call = host_call(request)

    def run() -> bytes:
        try:
            return serve(call)
        except NotAuthorized:
            call.budget.check()
            call.budget.spend()
            raise

    return Response(await run_in_threadpool(run), media_type="application/json")


HostDep = Annotated[int, Depends(current_host)]
AdminDep = Depends(require_admin)


SESSION_COOKIE = "crowdtrain_session"
READ_ONLY_METHODS = frozenset({"GET", "HEAD"})


def has_session(request: Request, settings: SettingsDep, r: RedisDep) -> bool:
    """Whether the request carries a live dashboard session cookie (crowdtrain.server.services.sessions).

    Only read-only requests may be admitted by the cookie, so that no other site can make a browser
    change anything with it (CSRF); everything that changes state takes the bearer token alone. A
    forged cookie is not a guess at a secret (it is an HMAC of 256 bits), so it spends no failure budget:
    a session ended by a new admin token would otherwise throttle the operator's open pages. A session
    ended by logout admits nothing (crowdtrain.server.services.sessions.is_live)."""
    if request.method not in READ_ONLY_METHODS:
        return False
    return sessions.is_live(r, settings.admin_token, request.cookies.get(SESSION_COOKIE))


def require_session(logged_in: Annotated[bool, Depends(has_session)]) -> None:
    """Admit a read-only request with a dashboard session (401 otherwise)."""
    if not logged_in:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "dashboard login required (POST /dashboard/login)")


SessionDep = Annotated[bool, Depends(has_session)]
RequireSession = Depends(require_session)
