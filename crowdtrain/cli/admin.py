"""`crowdtrain admin`: the operator's join tokens and registered hosts, through the scheduler's admin API."""

import json
from typing import Annotated

import typer

from crowdtrain.cli.adminapi import TokenOpt, admin_client, checked, checked_rows, print_rows
from crowdtrain.cli.options import DEFAULT_SERVER, HELP_LAYOUT, ServerOpt

app = typer.Typer(
    name="admin",
    help="Operator commands: join tokens and hosts (needs the admin token).",
    no_args_is_help=True,
    add_completion=False,
    **HELP_LAYOUT,
)
token_app = typer.Typer(help="Join tokens that let clients register.", no_args_is_help=True, **HELP_LAYOUT)
host_app = typer.Typer(help="Registered hosts.", no_args_is_help=True, **HELP_LAYOUT)
app.add_typer(token_app, name="join-token")
app.add_typer(host_app, name="host")


@token_app.command("create")
def token_create(
    label: Annotated[str, typer.Option(help="Who the token is for")],
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Issue a join token; it is printed once and only its hash is kept."""
    with admin_client(server, admin_token) as http:
        created = checked(http.post("/v1/admin/join-tokens", json={"label": label}))
    typer.echo(json.dumps(created))


@token_app.command("list")
def token_list(server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    with admin_client(server, admin_token) as http:
        print_rows(
            checked_rows(http.get("/v1/admin/join-tokens")),
            ["id", "label", "created_at", "revoked", "hosts_registered"],
        )


@token_app.command("revoke")
def token_revoke(token_id: int, server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """No new host can register with this token; registered hosts keep working."""
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post(f"/v1/admin/join-tokens/{token_id}/revoke"))))


@host_app.command("list")
def host_list(server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    with admin_client(server, admin_token) as http:
        print_rows(
            checked_rows(http.get("/v1/admin/hosts")),
            ["id", "name", "device", "last_seen", "revoked", "results_valid", "results_failed"],
        )


@host_app.command("revoke")
def host_revoke(host_id: int, server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """Refuse a host from now on; its running assignments are dispatched again at once."""
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post(f"/v1/admin/hosts/{host_id}/revoke"))))
