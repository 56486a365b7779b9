"""The FastAPI scheduler application.

Served as `uvicorn --factory crowdtrain.server.api.app:create_app` (what `crowdtrain server` runs) or as
`uvicorn crowdtrain.server.api.app:app`; either way the app is built only once it is served, and refuses to be
built with missing or published tokens (crowdtrain.core.settings.check_secrets).
"""

import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response, status

from crowdtrain.core import logs
from crowdtrain.core.schemas import Health, HealthReport
from crowdtrain.core.settings import Settings, check_secrets, get_settings
from crowdtrain.server.api import boundary
from crowdtrain.server.api.deps import Clients
from crowdtrain.server.api.routes import admin, dashboard, datasets, dedloc, experts, files, hosts, jobs, metrics, work
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.services import health

log = logging.getLogger(__name__)


@asynccontextmanager
async def _serving(app: FastAPI) -> AsyncIterator[None]:
    """Say when this process starts serving (a scheduler worker that its supervisor started again
    after a crash is back once it has said so; uvicorn's own startup lines are below its log level),
    and keep its health record while it serves (crowdtrain.server.services.health)."""
    log.info("scheduler process %d serving", os.getpid())
    heartbeat = health.Heartbeat(app.state.clients.redis, "scheduler", f"{socket.gethostname()}-{os.getpid()}")
    heartbeat.start()
    try:
        yield
    finally:
        heartbeat.stop()


def create_app(settings: Settings | None = None, evaluator: Evaluator | None = None) -> FastAPI:
    """The scheduler; `settings` replace the environment's and `evaluator` the framework's (tests).
    Raises InsecureSettings."""
    settings = settings or get_settings()
    check_secrets(settings)
    logs.configure(settings.log_format)
    app = FastAPI(title="crowdtrain scheduler", version="0.1.0", responses=boundary.ERROR_RESPONSES, lifespan=_serving)
    boundary.install(app, settings.body_max_bytes, settings.upload_slots, settings.upload_retry_after)
    # Read by crowdtrain.server.api.deps. Not a dependency override: FastAPI analyses an
    # override's signature again on every request, which cost a third of a work request's CPU.
    app.state.clients = Clients(settings, evaluator)
    for module in (hosts, work, files, jobs, datasets, admin, metrics):
        app.include_router(module.router)
    app.include_router(dedloc.router)
    app.include_router(dedloc.admin_router)
    app.include_router(experts.router)
    app.include_router(experts.admin_router)
    for router in dashboard.ROUTERS:
        app.include_router(router)

    @app.get("/v1/health/live", tags=["health"], response_model=Health)
    def live() -> Health:
        """This scheduler process is serving (what a supervisor or a readiness probe waits for)."""
        return Health()

    @app.get(
        "/v1/health",
        tags=["health"],
        response_model=HealthReport,
        responses={503: {"model": HealthReport, "description": "A part is down or a kind of process is missing"}},
    )
    def report(response: Response) -> HealthReport:
        """The database, Redis, object storage and each kind of long-running process (scheduler
        workers, parameter servers, transitioner): whether it is up and, for processes, how many
        reported and how recently. 503 when one is not."""
        clients: Clients = app.state.clients
        found = health.report(clients.db, clients.redis, clients.storage, time.time())
        if found.status != "ok":
            response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return found

    return app


def __getattr__(name: str) -> FastAPI:
    # `crowdtrain.server.api.app:app` is built on first access (PEP 562), not on import: importing this module for
    # create_app must not need the scheduler's secrets.
    if name == "app":
        return create_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
