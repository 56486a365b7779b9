"""`crowdtrain health`: the deployment's health as the scheduler reports it (`GET /v1/health`), or, with
`--local-process KIND`, whether this host's process of that kind keeps its health record in Redis fresh
(what a container's health check asks)."""

import socket
import time
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.table import Table

from crowdtrain.cli.options import DEFAULT_SERVER, HELP_LAYOUT, ServerOpt
from crowdtrain.core.schemas import HealthReport

app = typer.Typer(add_completion=False, **HELP_LAYOUT)


@app.command()
def health(
    server: ServerOpt = DEFAULT_SERVER,
    local_process: Annotated[
        str | None,
        typer.Option(
            metavar="KIND",
            show_default=False,
            help="Check only this host's KIND process (scheduler, parameter-server or transitioner) by its "
            "health record in Redis (CROWDTRAIN_REDIS_URL), not through the scheduler: "
            "exit 0 if it renewed the record within its time-to-live",
        ),
    ] = None,
) -> None:
    """The deployment's health: database, Redis, storage and each kind of process (GET /v1/health).

    Exits 1 when a part is down or a kind of process is missing, 3 when the scheduler cannot be reached."""
    if local_process is not None:
        raise typer.Exit(check_local_process(local_process))
    resp = httpx.get(f"{server.rstrip('/')}/v1/health", timeout=30)
    if resp.status_code not in (200, 503):
        typer.echo(f"error {resp.status_code}: {resp.text[:300]}", err=True)
        raise typer.Exit(1)
    found = HealthReport.model_validate_json(resp.content)
    table = Table("part", "ok", "processes", "newest report", "detail")
    for name, part in found.parts.items():
        age = "" if part.newest_age_seconds is None else f"{part.newest_age_seconds:.1f} s ago"
        processes = "" if part.processes is None else str(part.processes)
        table.add_row(name, "yes" if part.ok else "[red]NO[/red]", processes, age, part.detail)
    Console().print(table)
    typer.echo(f"status: {found.status}")
    raise typer.Exit(0 if found.status == "ok" else 1)


def check_local_process(kind: str) -> int:
    """0 if a `kind` process on this host renewed its health record within its time-to-live, 1 otherwise
    (also when Redis cannot be reached), saying which."""
    # The server's modules are imported here, not at the top: `crowdtrain health` without this option
    # also runs from the client image, which has no server dependencies.
    import redis

    from crowdtrain.core.settings import get_settings
    from crowdtrain.server.services.health import KINDS, TTL_SECONDS, host_report_age

    if kind not in KINDS:
        raise typer.BadParameter(f"must be one of {', '.join(KINDS)}, not {kind!r}", param_hint="--local-process")
    host = socket.gethostname()
    try:
        r = redis.Redis.from_url(get_settings().redis_url, socket_timeout=5, socket_connect_timeout=5)
        age = host_report_age(r, kind, host, time.time())
    except redis.RedisError as exc:
        typer.echo(f"Redis cannot be reached: {exc}", err=True)
        return 1
    if age is None:
        typer.echo(f"no {kind} on {host} has a health record", err=True)
        return 1
    if age > TTL_SECONDS:
        typer.echo(f"the {kind} on {host} last reported {age:.1f} s ago (more than {TTL_SECONDS:g} s)", err=True)
        return 1
    typer.echo(f"{kind} on {host}: reported {age:.1f} s ago")
    return 0
