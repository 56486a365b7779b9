"""`crowdtrain client install-service` and `uninstall-service`: the client as the user's own service,
started at login and restarted after a failure (crowdtrain.client.service writes and registers it)."""

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from crowdtrain.cli.errors import NOT_ENABLED, UserError
from crowdtrain.cli.options import (
    DEFAULT_CACHE,
    CacheOpt,
    JoinTokenFileOpt,
    JoinTokenOpt,
    OptionalServerOpt,
    resolve_join_token,
)
from crowdtrain.client import service
from crowdtrain.client.preferences import DEFAULT_PATH as DEFAULT_PREFERENCES
from crowdtrain.client.service import Platform, ServiceError, ServicePaths

PlatformOpt = Annotated[
    Platform | None,
    typer.Option(
        help="linux: a systemd user unit; macos: a launchd agent (default: this machine's)", show_default=False
    ),
]


def install_service(
    server: OptionalServerOpt = None,
    join_token: JoinTokenOpt = None,
    join_token_file: JoinTokenFileOpt = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="Preferences file the service reads (default ~/.config/crowdtrain/client.toml, written with "
            "every preference commented out if missing)",
            show_default=False,
        ),
    ] = None,
    cache: CacheOpt = DEFAULT_CACHE,
    enable: Annotated[
        bool, typer.Option("--enable/--no-enable", help="Start it now and at every login (--no-enable: only write it)")
    ] = True,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a service installed before (default: refuse)")
    ] = False,
    platform: PlatformOpt = None,
) -> None:
    """Install the client as your user's service, started now and at every login, restarted after a failure.

    Linux: a systemd user unit (~/.config/systemd/user/crowdtrain-client.service), enabled with
    `systemctl --user`; macOS: a launchd agent (~/Library/LaunchAgents/org.crowdtrain.client.plist).
    A join token given as a value is written to ~/.config/crowdtrain/service-join-token (mode 0600)
    and the service reads it from there. Exit 0 when the service is running (or written, with
    --no-enable); 4 when it was written but the service manager could not be reached (no user
    instance of systemd, as in most containers): the message gives the command that enables it.
    """
    if not server:
        raise UserError("install-service needs --server: the scheduler's URL (or set CROWDTRAIN_SERVER)")
    if not server.startswith(("http://", "https://")):
        raise UserError(f"--server {server!r} is not an http:// or https:// URL")
    try:
        token = resolve_join_token(join_token, join_token_file)
    except typer.BadParameter as exc:
        raise UserError(f"{exc.param_hint}: {exc.message}") from None
    chosen = _platform(platform)
    request = service.Installation(
        platform=chosen,
        paths=_paths(chosen),
        python=Path(sys.executable).absolute(),  # not resolved: a virtualenv's python is a link to the base one
        server=server,
        preferences=(config or DEFAULT_PREFERENCES).expanduser().absolute(),
        preferences_given=config is not None,
        cache=cache.expanduser().absolute(),
    )
    try:
        outcome = service.install(
            request, token if join_token_file is None else None, join_token_file, force=force, enable=enable
        )
    except ServiceError as exc:
        raise UserError(str(exc)) from None
    typer.echo("wrote " + ", ".join(map(str, outcome.files)))
    if not enable:
        typer.echo(f"not enabled (--no-enable); enable it with: {outcome.manual}")
    elif outcome.manager_error is not None:
        typer.echo(f"the service is written but not enabled: {outcome.manager_error}", err=True)
        typer.echo(f"enable it where your user's service manager runs with: {outcome.manual}", err=True)
        raise typer.Exit(NOT_ENABLED)
    elif chosen is Platform.linux:
        typer.echo(
            f"started {service.UNIT_NAME}; it starts at every login (logs: journalctl --user -u crowdtrain-client)"
        )
        typer.echo("to keep it running while you are logged out: loginctl enable-linger")
    else:
        typer.echo(f"loaded {service.LAUNCHD_LABEL}; it starts at every login (logs: {request.paths.logs})")


def uninstall_service(platform: PlatformOpt = None) -> None:
    """Stop the service install-service installed and remove its files; nothing installed is not an error.

    The join token file it wrote goes too, and the preferences file it wrote if it was never edited.
    """
    chosen = _platform(platform)
    paths = _paths(chosen)
    outcome = service.uninstall(chosen, paths, DEFAULT_PREFERENCES)
    if not outcome.files:
        typer.echo(f"nothing to uninstall: no service at {paths.service}")
        return
    if outcome.manager_error is not None:
        typer.echo(f"could not stop the service: {outcome.manager_error}", err=True)
        typer.echo(f"if it is still running, stop it with: {outcome.manual}", err=True)
    typer.echo("removed " + ", ".join(map(str, outcome.files)))
    if outcome.kept:
        typer.echo("kept " + ", ".join(map(str, outcome.kept)))


def _platform(given: Platform | None) -> Platform:
    chosen = given or service.this_platform()
    if chosen is None:
        raise UserError(
            f"install-service knows Linux (systemd) and macOS (launchd), not {sys.platform}: "
            "run `crowdtrain client` from your system's own start-up mechanism"
        )
    return chosen


def _paths(platform: Platform) -> ServicePaths:
    # XDG_CONFIG_HOME is where systemd looks for a user's units; it is the user's, not a crowdtrain setting.
    return ServicePaths.for_user(platform, Path.home(), os.environ.get("XDG_CONFIG_HOME"))
