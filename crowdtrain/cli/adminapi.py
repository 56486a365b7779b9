"""The scheduler's admin API as the operator's commands use it: an authenticated HTTP client, replies
checked (an error's detail printed, exit 2 for a refusal, 1 for a server fault), rows as a table."""

import json
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.console import Console
from rich.table import Table

from crowdtrain.cli.errors import UserError
from crowdtrain.core.settings import get_settings

TokenOpt = Annotated[str | None, typer.Option(help="Admin token (default: CROWDTRAIN_ADMIN_TOKEN)")]


def admin_client(server: str, token: str | None) -> httpx.Client:
    """An HTTP client of the admin routes; UserError when no admin token is given."""
    token = (token or get_settings().admin_token).strip()
    if not token:
        raise UserError(
            "no admin token: set CROWDTRAIN_ADMIN_TOKEN to the scheduler's admin token (or pass --admin-token)"
        )
    return httpx.Client(base_url=server, timeout=300, headers={"Authorization": f"Bearer {token}"})


def _reply(resp: httpx.Response) -> Any:
    """The JSON document of a successful reply; for an error, its detail printed and the command ended."""
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text
        typer.echo(
            f"error {resp.status_code}: {json.dumps(detail) if not isinstance(detail, str) else detail}", err=True
        )
        raise typer.Exit(2 if resp.status_code < 500 else 1)
    return resp.json()


def _malformed(resp: httpx.Response, expected: str) -> NoReturn:
    """A successful reply of the wrong shape is a server fault: exit 1, as for a 5xx."""
    typer.echo(f"error: the server's reply to {resp.request.url.path} is not {expected}", err=True)
    raise typer.Exit(1)


def checked(resp: httpx.Response) -> dict[str, Any]:
    """A reply that is one object (a created or changed record)."""
    document = _reply(resp)
    if not isinstance(document, dict):
        _malformed(resp, "an object")
    return document


def checked_rows(resp: httpx.Response) -> list[dict[str, Any]]:
    """A reply that lists records, one row each."""
    document = _reply(resp)
    if not isinstance(document, list) or not all(isinstance(row, dict) for row in document):
        _malformed(resp, "a list of objects")
    return document


def print_rows(rows: list[dict[str, Any]], columns: list[str], headers: dict[str, str] | None = None) -> None:
    """A table of `columns` of `rows`, under `headers` where given (shorter names keep it within 80 columns);
    floats with 3 significant digits, None as empty."""
    table = Table(*((headers or {}).get(c, c) for c in columns))
    for row in rows:
        table.add_row(*(_cell(row.get(c)) for c in columns))
    Console().print(table)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if isinstance(value, float) else str(value)
