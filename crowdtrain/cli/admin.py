"""`crowdtrain admin`: the operator's join tokens, registered hosts and project key, through the
scheduler's admin API (the private key stays on the operator's machine)."""

import json
from pathlib import Path
from typing import Annotated

import typer

from crowdtrain.cli.adminapi import TokenOpt, admin_client, checked, checked_rows, print_rows
from crowdtrain.cli.options import DEFAULT_SERVER, HELP_LAYOUT, ArgumentsCommand, ServerOpt
from crowdtrain.cli.projectkey import read_private_key, read_public_key, write_key_pair
from crowdtrain.core import signing

app = typer.Typer(
    name="admin",
    help="Operator commands: join tokens, hosts and the project key (needs the admin token).",
    no_args_is_help=True,
    add_completion=False,
    **HELP_LAYOUT,
)
token_app = typer.Typer(help="Join tokens that let clients register.", no_args_is_help=True, **HELP_LAYOUT)
host_app = typer.Typer(help="Registered hosts.", no_args_is_help=True, **HELP_LAYOUT)
key_app = typer.Typer(
    help="The project key that signs the project's work (the scheduler knows only its public half).",
    no_args_is_help=True,
    **HELP_LAYOUT,
)
app.add_typer(token_app, name="join-token")
app.add_typer(host_app, name="host")
app.add_typer(key_app, name="project-key")

HostIdArg = Annotated[
    int,
    typer.Argument(
        metavar="HOST_ID", help="The host's id, as `crowdtrain admin host list` shows it", show_default=False
    ),
]


@token_app.command("create")
def token_create(
    label: Annotated[str, typer.Option(help="Who the token is for")],
    account: Annotated[
        str,
        typer.Option(
            help="Issue it to this volunteer account: its hosts are under the account, whatever they name "
            "(default: none, its hosts name their own)"
        ),
    ] = "",
    registrations_per_hour: Annotated[
        int | None,
        typer.Option(min=1, help="Hosts it may register in any hour (default: the scheduler's limit per token)"),
    ] = None,
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Issue a join token; it is printed once and only its hash is kept."""
    body = {"label": label, "account": account, "registrations_per_hour": registrations_per_hour}
    with admin_client(server, admin_token) as http:
        created = checked(http.post("/v1/admin/join-tokens", json=body))
    typer.echo(json.dumps(created))


@token_app.command("list")
def token_list(server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """List the join tokens: label, account, registration limit, whether revoked and the hosts each registered."""
    with admin_client(server, admin_token) as http:
        print_rows(
            checked_rows(http.get("/v1/admin/join-tokens")),
            ["id", "label", "account", "registrations_per_hour", "created_at", "revoked", "hosts_registered"],
            {"registrations_per_hour": "per hour", "hosts_registered": "hosts"},
        )


@token_app.command("revoke", cls=ArgumentsCommand)
def token_revoke(
    token_id: Annotated[
        int,
        typer.Argument(
            metavar="TOKEN_ID",
            help="The token's id, as `crowdtrain admin join-token list` shows it",
            show_default=False,
        ),
    ],
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """No new host can register with this token; registered hosts keep working."""
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post(f"/v1/admin/join-tokens/{token_id}/revoke"))))


@host_app.command("list")
def host_list(server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """List the registered hosts: device, whether revoked, valid and failed results, reputation, quarantine."""
    with admin_client(server, admin_token) as http:
        rows = checked_rows(http.get("/v1/admin/hosts"))
    for row in rows:  # the date and the reason are on the dashboard's hosts page and in the API
        row["quarantined"] = "yes" if row.get("quarantined_until") else ""
    print_rows(
        rows,
        ["id", "name", "device", "revoked", "results_valid", "results_failed", "reputation", "quarantined"],
        {"results_valid": "valid", "results_failed": "failed"},
    )


@host_app.command("revoke", cls=ArgumentsCommand)
def host_revoke(host_id: HostIdArg, server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """Refuse a host from now on; its running assignments are dispatched again at once."""
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post(f"/v1/admin/hosts/{host_id}/revoke"))))


@host_app.command("release", cls=ArgumentsCommand)
def host_release(host_id: HostIdArg, server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """End a host's quarantine (repeated refused results) now; it gets work again, on probation."""
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post(f"/v1/admin/hosts/{host_id}/release"))))


@app.command("keygen")
def keygen(out: Annotated[Path, typer.Option(help="Folder for project.key and project.pub")]) -> None:
    """Make an Ed25519 project key on this machine: OUT/project.key (private, mode 0600: keep it here,
    never on the scheduler) and OUT/project.pub. Never overwrites a key."""
    try:
        private, public, public_key = write_key_pair(out.expanduser())
    except FileExistsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps({"private_key": str(private), "public_key_file": str(public), "public_key": public_key}))


@key_app.command("show")
def key_show(server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """The public key that signs the project's work now, and its rotations."""
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.get("/v1/admin/project-key"))))


@key_app.command("set", cls=ArgumentsCommand)
def key_set(
    public_key_file: Annotated[
        Path,
        typer.Argument(
            metavar="PUBLIC_KEY_FILE", help="project.pub from `crowdtrain admin keygen`", show_default=False
        ),
    ],
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Give the scheduler the project's first public key (project.pub): from now on each job waits for
    its recipe's signature (`crowdtrain job submit --key`). A key in use changes only by `rotate`."""
    public_key = read_public_key(public_key_file)
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post("/v1/admin/project-key", json={"public_key": public_key}))))


@key_app.command("rotate")
def key_rotate(
    old: Annotated[Path, typer.Option(help="The private key in use (project.key)")],
    new: Annotated[Path, typer.Option(help="The new key's public half (project.pub), or its private key")],
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Move the project to a new key with a statement signed here by the old one; clients that trust the
    old key follow it. Then sign the running jobs again with the new key (`crowdtrain job sign`)."""
    old_key = read_private_key(old)
    new_public = signing.public_key_text(read_private_key(new)) if new.suffix == ".key" else read_public_key(new)
    rotation = {
        "old_public_key": signing.public_key_text(old_key),
        "new_public_key": new_public,
        "signature": signing.sign_rotation(old_key, new_public),
    }
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post("/v1/admin/project-key/rotations", json=rotation))))
