"""`crowdtrain client`: run the volunteer client, or see what the one using a cache is doing."""

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from crowdtrain.cli.client_service import install_service, uninstall_service
from crowdtrain.cli.errors import UserError
from crowdtrain.cli.options import (
    DEFAULT_CACHE,
    HELP_LAYOUT,
    CacheOpt,
    JoinTokenFileOpt,
    JoinTokenOpt,
    OptionalServerOpt,
    ProjectKeyOpt,
    configure_logging,
    resolve_join_token,
    resolve_project_key,
)
from crowdtrain.client.cachelock import CacheInUse
from crowdtrain.client.config import ClientConfig
from crowdtrain.client.devices import DeviceUnavailable, detect_accelerators, resolve_device
from crowdtrain.client.preferences import Preferences, PreferencesError, load_preferences
from crowdtrain.client.status import is_running, now_utc, read_status, render
from crowdtrain.client.trainers import available_frameworks, limit_threads
from crowdtrain.client.worker import VolunteerClient
from crowdtrain.core.frameworks import Framework, is_framework

app = typer.Typer(
    name="client",
    help="The volunteer client: run it, or see what it is doing.\n\n"
    "To run it as your user's service, started at login and restarted after a failure (a systemd user unit "
    "on Linux, a launchd agent on macOS): `crowdtrain client install-service --server URL --join-token-file "
    "FILE`; `crowdtrain client uninstall-service` stops and removes it.",
    add_completion=False,
    **HELP_LAYOUT,
)
app.command("install-service")(install_service)
app.command("uninstall-service")(uninstall_service)


def _limit(what: str, example: str) -> Any:
    """An optional size or rate limit: no limit unless given."""
    return typer.Option(help=f"{what}, e.g. {example} (default: no limit)", show_default=False)


@app.callback(invoke_without_command=True)
def client(
    ctx: typer.Context,
    server: OptionalServerOpt = None,
    join_token: JoinTokenOpt = None,
    join_token_file: JoinTokenFileOpt = None,
    config: Annotated[
        Path | None,
        typer.Option(help="Preferences file (default ~/.config/crowdtrain/client.toml)", show_default=False),
    ] = None,
    cache: CacheOpt = DEFAULT_CACHE,
    tasks: Annotated[int | None, typer.Option(help="Assignments trained at once (default 1)")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N or mps (default auto)")] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads for training (default: the framework's)")] = None,
    idle_only: Annotated[
        bool | None,
        typer.Option("--idle-only/--no-idle-only", help="Work only while the machine is idle (default: no)"),
    ] = None,
    idle_minutes: Annotated[
        float | None,
        typer.Option(help="Minutes without input or CPU use by others that make the machine idle (default 3)"),
    ] = None,
    idle_cpu_percent: Annotated[
        float | None, typer.Option(help="CPU use by others (% of all cores) that counts as busy (default 25)")
    ] = None,
    cache_max_bytes: Annotated[str | None, _limit("Bytes of shards and snapshots kept", "20GB")] = None,
    daily_download_bytes: Annotated[str | None, _limit("Bytes downloaded per UTC day", "5GB")] = None,
    daily_upload_bytes: Annotated[str | None, _limit("Bytes uploaded per UTC day", "1GB")] = None,
    max_download_rate: Annotated[str | None, _limit("Download bytes per second", "2MB")] = None,
    max_upload_rate: Annotated[str | None, _limit("Upload bytes per second", "1MB")] = None,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="Object store (scheme://host:port) to download shards and snapshots from, besides the scheduler "
            "and the store it names at registration; repeat for more",
            show_default=False,
        ),
    ] = None,
    account: Annotated[
        str | None,
        typer.Option(
            help="Volunteer account this host's credit adds up under on the public project page, given at "
            "registration (default: none, shown as anonymous)",
            show_default=False,
        ),
    ] = None,
    bind_address: Annotated[
        str | None,
        typer.Option(help="Local address to send requests from (default: the system's choice)", show_default=False),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Host name shown to the operator (default: HOSTNAME-PID)", show_default=False)
    ] = None,
    max_assignments: Annotated[
        int | None, typer.Option(help="Exit after this many assignments (default: never)", show_default=False)
    ] = None,
    prefetch: Annotated[bool, typer.Option(help="Fetch the next assignment's files while training")] = True,
    checkpoint_seconds: Annotated[
        float, typer.Option(min=0, help="Checkpoint running training this often (0: never); a restarted client resumes")
    ] = 30.0,
    spot_notice_url: Annotated[
        str,
        typer.Option(
            help="Spot-interruption notice to poll, e.g. AWS IMDSv2 "
            "http://169.254.169.254/latest/meta-data/spot/instance-action (default: none)",
            show_default=False,
        ),
    ] = "",
    spot_poll_seconds: Annotated[float, typer.Option(min=0.1, help="Seconds between notice polls")] = 5.0,
    sigterm_grace: Annotated[
        float, typer.Option(min=0, help="On SIGTERM, let training that ends within this many seconds finish and upload")
    ] = 0.0,
    frameworks: Annotated[
        str | None,
        typer.Option(help="Comma list of frameworks to train with: pytorch, tensorflow (default: all installed)"),
    ] = None,
    project_key: ProjectKeyOpt = None,
) -> None:
    """Run the volunteer client until stopped (SIGTERM/Ctrl-C abandon running work and exit cleanly).

    Preferences (tasks through account) come from the --config file; each one given here
    overrides the file.
    """
    if ctx.invoked_subcommand is not None:
        _refuse_options_before(ctx)
        return
    if not server:
        raise typer.BadParameter("required to run the client", param_hint="--server")
    join_token = resolve_join_token(join_token, join_token_file)
    prefs, resolved = _client_preferences(
        config,
        dict(
            tasks=tasks,
            device=device,
            threads=threads,
            idle_only=idle_only,
            idle_minutes=idle_minutes,
            idle_cpu_percent=idle_cpu_percent,
            cache_max_bytes=cache_max_bytes,
            daily_download_bytes=daily_download_bytes,
            daily_upload_bytes=daily_upload_bytes,
            max_download_rate=max_download_rate,
            max_upload_rate=max_upload_rate,
            download_origins=allow_origin or None,
            account=account,
            bind_address=bind_address,
        ),
    )
    pinned = resolve_project_key(project_key) if project_key else None
    configure_logging()
    chosen = _client_frameworks(frameworks)
    if prefs.threads:
        limit_threads(prefs.threads, chosen)
    settings = ClientConfig(
        server,
        join_token,
        prefs.tasks,
        resolved,
        cache.expanduser(),
        name,
        max_assignments,
        prefetch=prefetch,
        checkpoint_seconds=checkpoint_seconds,
        spot_notice_url=spot_notice_url,
        spot_poll_seconds=spot_poll_seconds,
        sigterm_grace=sigterm_grace,
        max_download_rate=prefs.max_download_rate,
        max_upload_rate=prefs.max_upload_rate,
        preferences=prefs,
        frameworks=chosen,
        project_key=pinned,
    )
    c = VolunteerClient(settings)
    c.install_signal_handlers()
    try:
        code = c.run()
    except CacheInUse as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def _refuse_options_before(ctx: typer.Context) -> None:
    """`crowdtrain client --server URL install-service` would drop --server: the command's options follow its name."""
    given = [p.opts[0] for p in ctx.command.params if p.name and _from_command_line(ctx, p.name)]
    if given:
        raise UserError(
            f"{', '.join(given)}: give these after the command's name (crowdtrain client {ctx.invoked_subcommand} "
            f"{given[0]} ...); only running the client itself takes them first"
        )


def _from_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _client_preferences(config: Path | None, overrides: dict) -> tuple[Preferences, str]:
    """The preferences in force and the resolved device; exit 2 naming the field if either is unusable."""
    try:
        prefs = load_preferences(config, overrides)
        try:
            return prefs, resolve_device(prefs.device, detect_accelerators())
        except DeviceUnavailable as exc:
            raise PreferencesError(f"invalid preference `device`: {exc}") from None
    except PreferencesError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


@app.command("status")
def client_status(cache: CacheOpt = DEFAULT_CACHE) -> None:
    """Show what the client using this cache is doing now; exit 1 if it is not running."""
    status = read_status(cache.expanduser())
    if status is None or not is_running(status, now_utc()):
        last = f" (last seen {status.updated_at.isoformat(timespec='seconds')}, {status.state.value})" if status else ""
        typer.echo(f"not running{last}")
        raise typer.Exit(1)
    Console().print(render(status))


def _client_frameworks(option: str | None) -> list[Framework]:
    """The frameworks named by --frameworks, each checked to be installed here."""
    have = available_frameworks()
    if option is None:
        return have
    names = [f.strip() for f in option.split(",") if f.strip()]
    chosen = [f for f in names if is_framework(f) and f in have]
    missing = [f for f in names if f not in chosen]
    if not names or missing:
        raise typer.BadParameter(
            f"{', '.join(missing) or 'none given'}: installed frameworks are {', '.join(have)}",
            param_hint="--frameworks",
        )
    return chosen
