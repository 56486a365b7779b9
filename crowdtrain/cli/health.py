"""`crowdtrain health`: the deployment's health as the scheduler reports it (`GET /v1/health`), or, with
`--local-process KIND`, whether this host's process of that kind keeps its health record in Redis fresh
(what a container's health check asks)."""

import importlib
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
        # Loaded by name, as LazyCommand loads a command's module: `crowdtrain health` without this
        # option also runs from the client image, which has none of the server's packages.
        check = importlib.import_module("crowdtrain.cli.local_health").check_local_process
        raise typer.Exit(check(local_process))
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
