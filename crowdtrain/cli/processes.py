"""The server's processes: `migrate`, `server` (the scheduler), `assimilator-worker` (a parameter
server's Celery worker, which `crowdtrain assimilator` supervises) and `transitioner`. Each needs the
server extra (`pip install 'crowdtrain[server]'`)."""

import logging
import os
import signal
import socket
import threading
from typing import Annotated

import typer
import uvicorn

from crowdtrain.assimilator.evaluate import FrameworkEvaluator
from crowdtrain.assimilator.expert_weights import ExpertCheckpoints
from crowdtrain.assimilator.worker.celery_app import celery_app, enqueue_merge
from crowdtrain.cli.options import HELP_LAYOUT, configure_logging
from crowdtrain.core import keys
from crowdtrain.core.settings import InsecureSettings, check_secrets, get_settings
from crowdtrain.core.storage import open_storage
from crowdtrain.migrations import upgrade, wait_for_schema
from crowdtrain.server.api.transport import KEEP_ALIVE_S, NoDelayHttpToolsProtocol
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.paramstore import store
from crowdtrain.server.services import health
from crowdtrain.server.services.transitioner import run_forever

app = typer.Typer(add_completion=False, **HELP_LAYOUT)

# uvicorn's supervisor pings each worker process and kills one that has not answered within this many
# seconds. The answer needs the worker's GIL: its default (5 s) killed a worker, and the requests it
# held, when a long computation held the GIL or the machine was loaded, though the worker was alive.
# A minute is long enough for that and short enough to replace a worker that is truly stuck.
WORKER_HEALTHCHECK_S = 60


@app.command()
def migrate() -> None:
    """Bring the database to the latest schema (`alembic upgrade head`) and exit."""
    configure_logging()
    settings = get_settings()
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.resolved_database_url)


@app.command()
def server(
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes")] = 1,
    run_migrations: Annotated[
        bool, typer.Option("--migrate/--no-migrate", help="Run `alembic upgrade head` before serving")
    ] = True,
) -> None:
    """Run the scheduler (it needs CROWDTRAIN_ADMIN_TOKEN; CROWDTRAIN_JOIN_TOKEN is optional)."""
    settings = get_settings()
    try:
        check_secrets(settings)
    except InsecureSettings as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if run_migrations:
        migrate()
    else:
        configure_logging()
    uvicorn.run(
        "crowdtrain.server.api.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        # info: the supervisor says so when it replaces a worker; one line per request would cost.
        log_level="info",
        access_log=False,
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
        http=NoDelayHttpToolsProtocol,
        loop="uvloop",
        timeout_keep_alive=KEEP_ALIVE_S,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local process, or a proxy
        # that passes the header on, could then pick the address failed logins are throttled by.
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=settings.trusted_proxies,
    )


@app.command("assimilator-worker", hidden=True)
def assimilator_worker(concurrency: Annotated[int, typer.Option(min=1)] = 1) -> None:
    """The Celery worker of a parameter server (`crowdtrain assimilator` starts and supervises it)."""
    configure_logging()
    heartbeat = health.Heartbeat(
        store.connect(get_settings().redis_url), "parameter-server", f"{socket.gethostname()}-{os.getpid()}"
    ).start()
    try:
        _celery_worker(concurrency)
    finally:
        heartbeat.stop()


def _celery_worker(concurrency: int) -> None:
    celery_app.worker_main(
        [
            "worker",
            "--concurrency",
            str(concurrency),
            "--loglevel",
            "INFO",
            "--pool",
            "prefork",
            "-Q",
            keys.ASSIMILATE_QUEUE,
            "--without-gossip",
            "--without-mingle",
            "-n",
            "assimilator@%h-%i",
        ]
    )


@app.command()
def transitioner() -> None:
    """Run the transitioner loop: deadlines, retries, stalled merges."""
    configure_logging()
    settings = get_settings()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if not wait_for_schema(settings.resolved_database_url, stop):
        return
    logging.getLogger(__name__).info("transitioner running every %.1fs", settings.transitioner_interval)
    r = store.connect(settings.redis_url)
    heartbeat = health.Heartbeat(r, "transitioner", f"{socket.gethostname()}-{os.getpid()}").start()
    try:
        db = session_factory(settings.resolved_database_url)
        storage = open_storage(settings.resolved_storage_url, settings.s3_endpoint_url)
        run_forever(
            db,
            storage,
            r,
            FrameworkEvaluator(ExpertCheckpoints(db, storage)),
            settings.transitioner_interval,
            settings.stuck_upload_seconds,
            enqueue_merge,
            stop,
        )
    finally:
        heartbeat.stop()
