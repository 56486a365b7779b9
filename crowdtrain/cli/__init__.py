"""The `crowdtrain` command line. Each command only moves data in and out of the services."""

import json
import logging
import threading
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="crowdtrain: train deep-learning models on compute that comes and goes.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
job_app = typer.Typer(help="Submit and follow training jobs (needs the admin token).", no_args_is_help=True)
app.add_typer(job_app, name="job")
admin_app = typer.Typer(help="Operator commands: join tokens and hosts (needs the admin token).", no_args_is_help=True)
token_app = typer.Typer(help="Join tokens that let clients register.", no_args_is_help=True)
host_app = typer.Typer(help="Registered hosts.", no_args_is_help=True)
admin_app.add_typer(token_app, name="join-token")
admin_app.add_typer(host_app, name="host")
app.add_typer(admin_app, name="admin")


def _logging(level: str = "INFO") -> None:
    from crowdtrain.core import logs
    from crowdtrain.core.settings import get_settings

    logs.configure(get_settings().log_format, level)


@app.command()
def migrate() -> None:
    """Bring the database to the latest schema (`alembic upgrade head`) and exit."""
    from crowdtrain.core.settings import get_settings
    from crowdtrain.migrations import upgrade

    _logging()
    settings = get_settings()
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.resolved_database_url)


@app.command()
def server(
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes")] = 1,
    run_migrations: Annotated[bool, typer.Option("--migrate/--no-migrate",
                                                 help="Run `alembic upgrade head` before serving")] = True,
) -> None:
    """Run the scheduler (it needs CROWDTRAIN_ADMIN_TOKEN; CROWDTRAIN_JOIN_TOKEN is optional)."""
    import uvicorn

    from crowdtrain.core.settings import InsecureSettings, check_secrets, get_settings

    try:
        check_secrets(get_settings())
    except InsecureSettings as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if run_migrations:
        migrate()
    else:
        _logging()
    uvicorn.run("crowdtrain.server.api.app:create_app", factory=True, host=host, port=port, workers=workers, log_level="warning")


@app.command()
def assimilator(
    concurrency: Annotated[int, typer.Option(min=1)] = 1,
    supervise: Annotated[bool, typer.Option("--supervise/--no-supervise",
                                            help="Restart the Celery worker if it dies")] = True,
) -> None:
    """Run a parameter server: a Celery worker with `concurrency` processes, restarted if it dies."""
    import sys

    _logging()
    if supervise:
        from crowdtrain.launch.supervise import supervise as run_supervised

        argv = [sys.executable, "-m", "crowdtrain", "assimilator", "--concurrency", str(concurrency),
                "--no-supervise"]
        raise typer.Exit(run_supervised(argv, "the parameter server's Celery worker"))
    from crowdtrain.assimilator.worker.celery_app import celery_app
    from crowdtrain.core import keys

    celery_app.worker_main(["worker", "--concurrency", str(concurrency), "--loglevel", "INFO", "--pool", "prefork",
                            "-Q", keys.ASSIMILATE_QUEUE, "--without-gossip", "--without-mingle", "-n",
                            "assimilator@%h-%i"])


@app.command()
def transitioner() -> None:
    """Run the transitioner loop: deadlines, retries, stalled merges."""
    import signal

    from crowdtrain.server.ledger import paramstore
    from crowdtrain.assimilator.worker.celery_app import enqueue_merge
    from crowdtrain.core.settings import get_settings
    from crowdtrain.core.storage import open_storage
    from crowdtrain.server.ledger.db import session_factory
    from crowdtrain.server.services.transitioner import run_forever

    _logging()
    settings = get_settings()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logging.getLogger(__name__).info("transitioner running every %.1fs", settings.transitioner_interval)
    run_forever(session_factory(settings.resolved_database_url),
                open_storage(settings.resolved_storage_url, settings.s3_endpoint_url),
                paramstore.connect(settings.redis_url), settings.transitioner_interval,
                settings.stuck_upload_seconds, enqueue_merge, stop)


# The join token is a secret: from the environment or a file, it stays out of `ps`.
JOIN_TOKEN_ENV = "CROWDTRAIN_CLIENT_JOIN_TOKEN"
JoinTokenOpt = Annotated[str | None, typer.Option(envvar=JOIN_TOKEN_ENV, show_envvar=True, show_default=False,
                                                  help="Join token from the project operator (visible in `ps`: "
                                                       f"prefer {JOIN_TOKEN_ENV} or --join-token-file)")]
JoinTokenFileOpt = Annotated[Path | None, typer.Option(help="File holding the join token", show_default=False)]


def _join_token(token: str | None, token_file: Path | None) -> str:
    """The join token from --join-token / CROWDTRAIN_CLIENT_JOIN_TOKEN or --join-token-file (exactly one)."""
    if token and token_file is not None:
        raise typer.BadParameter(f"give the join token once: --join-token (or {JOIN_TOKEN_ENV}) or "
                                 "--join-token-file", param_hint="--join-token-file")
    if token_file is not None:
        try:
            token = token_file.expanduser().read_text().strip()
        except OSError as exc:
            raise typer.BadParameter(f"cannot read {token_file}: {exc.strerror}", param_hint="--join-token-file")
        if not token:
            raise typer.BadParameter(f"{token_file} is empty", param_hint="--join-token-file")
    if not token:
        raise typer.BadParameter(f"required: --join-token-file, {JOIN_TOKEN_ENV} or --join-token",
                                 param_hint="--join-token")
    return token


client_app = typer.Typer(help="The volunteer client: run it, or see what it is doing.")
app.add_typer(client_app, name="client")
DEFAULT_CACHE = Path("~/.cache/crowdtrain")
CacheOpt = Annotated[Path, typer.Option(help="Cache of shards, snapshots, the host token and the status file")]
SizeOpt = Annotated[str | None, typer.Option(help="Bytes, e.g. 500MB or 2GiB", show_default=False)]
RateOpt = Annotated[str | None, typer.Option(help="Bytes per second, e.g. 2MB", show_default=False)]


@client_app.callback(invoke_without_command=True)
def client(
    ctx: typer.Context,
    server: Annotated[str | None, typer.Option(help="Scheduler URL")] = None,
    join_token: JoinTokenOpt = None,
    join_token_file: JoinTokenFileOpt = None,
    config: Annotated[Path | None, typer.Option(help="Preferences file (default ~/.config/crowdtrain/client.toml)",
                                                show_default=False)] = None,
    cache: CacheOpt = DEFAULT_CACHE,
    tasks: Annotated[int | None, typer.Option(help="Assignments trained at once (default 1)")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N or mps (default auto)")] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads for training")] = None,
    idle_only: Annotated[bool | None, typer.Option("--idle-only/--no-idle-only",
                                                   help="Work only while the machine is idle")] = None,
    idle_minutes: Annotated[float | None, typer.Option(help="Minutes without input or CPU use by others that make "
                                                            "the machine idle (default 3)")] = None,
    idle_cpu_percent: Annotated[float | None, typer.Option(help="CPU use by others (% of all cores) that counts as "
                                                                "busy (default 25)")] = None,
    cache_max_bytes: SizeOpt = None,
    daily_download_bytes: SizeOpt = None,
    daily_upload_bytes: SizeOpt = None,
    max_download_rate: RateOpt = None,
    max_upload_rate: RateOpt = None,
    allow_origin: Annotated[list[str] | None, typer.Option(
        help="Object store (scheme://host:port) to download shards and snapshots from, besides the scheduler "
             "and the store it names at registration; repeat for more", show_default=False)] = None,
    name: Annotated[str | None, typer.Option(help="Host name shown to the operator")] = None,
    max_assignments: Annotated[int | None, typer.Option(help="Exit after this many assignments")] = None,
    prefetch: Annotated[bool, typer.Option(help="Fetch the next assignment's files while training")] = True,
    checkpoint_seconds: Annotated[float, typer.Option(
        min=0, help="Checkpoint running training this often (0: never); a restarted client resumes")] = 30.0,
    spot_notice_url: Annotated[str, typer.Option(
        help="Spot-interruption notice to poll, e.g. AWS IMDSv2 "
             "http://169.254.169.254/latest/meta-data/spot/instance-action; empty: none")] = "",
    spot_poll_seconds: Annotated[float, typer.Option(min=0.1, help="Seconds between notice polls")] = 5.0,
    sigterm_grace: Annotated[float, typer.Option(
        min=0, help="On SIGTERM, let training that ends within this many seconds finish and upload")] = 0.0,
    frameworks: Annotated[str | None, typer.Option(
        help="Comma list of frameworks to train with: pytorch, tensorflow (default: all installed)")] = None,
) -> None:
    """Run the volunteer client until stopped (SIGTERM/Ctrl-C abandon running work and exit cleanly).

    Preferences (tasks through allow-origin) come from the --config file; each one given here
    overrides the file.
    """
    if ctx.invoked_subcommand is not None:
        return
    if not server:
        raise typer.BadParameter("required to run the client", param_hint="--server")
    join_token = _join_token(join_token, join_token_file)
    prefs, resolved = _client_preferences(config, dict(
        tasks=tasks, device=device, threads=threads, idle_only=idle_only, idle_minutes=idle_minutes,
        idle_cpu_percent=idle_cpu_percent, cache_max_bytes=cache_max_bytes, daily_download_bytes=daily_download_bytes,
        daily_upload_bytes=daily_upload_bytes, max_download_rate=max_download_rate, max_upload_rate=max_upload_rate,
        download_origins=allow_origin or None))
    from crowdtrain.client.trainers import limit_threads
    from crowdtrain.client.worker import VolunteerClient

    _logging()
    chosen = _client_frameworks(frameworks)
    if prefs.threads:
        limit_threads(prefs.threads, chosen)
    c = VolunteerClient(server, join_token, prefs.tasks, resolved, cache.expanduser(), name, max_assignments,
                        prefetch=prefetch, checkpoint_seconds=checkpoint_seconds, spot_notice_url=spot_notice_url,
                        spot_poll_seconds=spot_poll_seconds, sigterm_grace=sigterm_grace,
                        max_download_rate=prefs.max_download_rate, max_upload_rate=prefs.max_upload_rate,
                        preferences=prefs, frameworks=chosen)
    c.install_signal_handlers()
    raise typer.Exit(c.run())


def _client_preferences(config: Path | None, overrides: dict) -> tuple:
    """The preferences in force and the resolved device; exit 2 naming the field if either is unusable."""
    from crowdtrain.client.devices import DeviceUnavailable, detect_accelerators, resolve_device
    from crowdtrain.client.preferences import PreferencesError, load_preferences

    try:
        prefs = load_preferences(config, overrides)
        try:
            return prefs, resolve_device(prefs.device, detect_accelerators())
        except DeviceUnavailable as exc:
            raise PreferencesError(f"invalid preference `device`: {exc}") from None
    except PreferencesError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


@client_app.command("status")
def client_status(cache: CacheOpt = DEFAULT_CACHE) -> None:
    """Show what the client using this cache is doing now; exit 1 if it is not running."""
    from rich.console import Console

    from crowdtrain.client.status import is_running, now_utc, read_status, render

    status = read_status(cache.expanduser())
    if not is_running(status, now_utc()):
        last = f" (last seen {status.updated_at.isoformat(timespec='seconds')}, {status.state.value})" if status else ""
        typer.echo(f"not running{last}")
        raise typer.Exit(1)
    Console().print(render(status))


def _client_frameworks(option: str | None) -> list[str]:
    """The frameworks named by --frameworks, each checked to be installed here."""
    from crowdtrain.client.trainers import available_frameworks

    have = available_frameworks()
    if option is None:
        return have
    chosen = [f.strip() for f in option.split(",") if f.strip()]
    missing = [f for f in chosen if f not in have]
    if not chosen or missing:
        raise typer.BadParameter(f"{', '.join(missing) or 'none given'}: installed frameworks are {', '.join(have)}",
                                 param_hint="--frameworks")
    return chosen


@app.command()
def peer(
    server: Annotated[str, typer.Option(help="Scheduler URL")],
    job: Annotated[int, typer.Option(help="The dedloc job to train")],
    join_token: JoinTokenOpt = None,
    join_token_file: JoinTokenFileOpt = None,
    name: Annotated[str, typer.Option(help="Host name shown to the operator")] = "dedloc-peer",
    relayed: Annotated[bool, typer.Option(help="This peer cannot accept connections (NAT): the server "
                                               "reduces for it")] = False,
    data_rank: Annotated[int, typer.Option(min=0, help="Train on examples i with i % data_world == data_rank")] = 0,
    data_world: Annotated[int, typer.Option(min=1)] = 1,
    examples_per_step: Annotated[int | None, typer.Option(min=1, help="Contribute at most this many examples "
                                                                     "per step")] = None,
    trace: Annotated[Path | None, typer.Option(help="Append one JSON line per applied step")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads for training")] = None,
    kill_at: Annotated[str | None, typer.Option(help="Testing: SIGKILL itself mid all-reduce of STEP:ATTEMPT")] = None,
) -> None:
    """Run a peer of a synchronous DeDLOC job until the job finishes."""
    join_token = _join_token(join_token, join_token_file)
    import torch

    from crowdtrain.client.dedloc.api import PeerAPI
    from crowdtrain.client.dedloc.peer import DedlocPeer, PeerOptions

    _logging()
    if data_rank >= data_world:
        raise typer.BadParameter(f"must be below --data-world ({data_world})", param_hint="--data-rank")
    if threads:
        torch.set_num_threads(threads)
    api = PeerAPI(server)
    api.register(join_token, name)
    at = tuple(int(v) for v in kill_at.split(":")) if kill_at else None
    options = PeerOptions(job_id=job, relayed=relayed, data_rank=data_rank, data_world=data_world,
                          examples_per_step=examples_per_step, trace=trace, kill_at=at)
    raise typer.Exit(DedlocPeer(api, options).run())


def _admin(server: str, token: str | None):
    import httpx

    from crowdtrain.core.settings import get_settings

    return httpx.Client(base_url=server, timeout=300,
                        headers={"Authorization": f"Bearer {token or get_settings().admin_token}"})


ServerOpt = Annotated[str, typer.Option(help="Scheduler URL")]
TokenOpt = Annotated[str | None, typer.Option(help="Admin token (default: CROWDTRAIN_ADMIN_TOKEN)")]


def _check(resp) -> dict:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text
        typer.echo(f"error {resp.status_code}: {json.dumps(detail) if not isinstance(detail, str) else detail}",
                   err=True)
        raise typer.Exit(2 if resp.status_code < 500 else 1)
    return resp.json()


@job_app.command("submit")
def job_submit(spec: Path, server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    """Submit a job spec (YAML or JSON); prints the new job's id.

    A relative `npz:PATH` dataset is resolved against the spec file's folder and sent as an
    absolute path, which the scheduler reads on its own machine."""
    from pydantic import ValidationError

    from crowdtrain.core.jobspec import load_job_spec
    from crowdtrain.core.specfile import SpecFileError

    notes: list[str] = []
    try:
        parsed = load_job_spec(spec, notes)
    except SpecFileError as exc:  # its one line names the file
        typer.echo(f"invalid job spec: {exc}", err=True)
        raise typer.Exit(2) from None
    except (OSError, ValueError, ValidationError) as exc:
        typer.echo(f"invalid job spec {spec}: {exc}", err=True)
        raise typer.Exit(2) from None
    for note in notes:
        typer.echo(note, err=True)
    with _admin(server, admin_token) as http:
        created = _check(http.post("/v1/jobs", json=parsed.model_dump(mode="json")))
    typer.echo(json.dumps(created))


@job_app.command("status")
def job_status(job_id: int, server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    """Print a job's status with per-epoch figures."""
    from crowdtrain.cli.progress import status_table
    from crowdtrain.core.schemas import JobStatusOut
    from rich.console import Console

    with _admin(server, admin_token) as http:
        st = JobStatusOut.model_validate(_check(http.get(f"/v1/jobs/{job_id}")))
    Console().print(status_table(st, last_epochs=None))


@job_app.command("watch")
def job_watch(job_id: int, server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    """Follow a job until it finishes; exits 0 if it succeeded."""
    from crowdtrain.cli.progress import watch

    with _admin(server, admin_token) as http:
        st = watch(http, job_id)
    raise typer.Exit(0 if st.status == "succeeded" else 1)


@job_app.command("cancel")
def job_cancel(job_id: int, server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    with _admin(server, admin_token) as http:
        typer.echo(json.dumps(_check(http.post(f"/v1/jobs/{job_id}/cancel"))))


@job_app.command("download")
def job_download(job_id: int, output: Annotated[Path, typer.Option("-o", "--output")],
                 server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    """Save the final model (safetensors) of a finished job."""
    with _admin(server, admin_token) as http:
        resp = http.get(f"/v1/jobs/{job_id}/model")
        if resp.status_code >= 400:
            _check(resp)
        output.write_bytes(resp.content)
    typer.echo(f"wrote {output} ({len(resp.content)} bytes)")


def _print_rows(rows: list[dict], columns: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    Console().print(table)


@token_app.command("create")
def token_create(label: Annotated[str, typer.Option(help="Who the token is for")],
                 server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    """Issue a join token; it is printed once and only its hash is kept."""
    with _admin(server, admin_token) as http:
        created = _check(http.post("/v1/admin/join-tokens", json={"label": label}))
    typer.echo(json.dumps(created))


@token_app.command("list")
def token_list(server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    with _admin(server, admin_token) as http:
        _print_rows(_check(http.get("/v1/admin/join-tokens")),
                    ["id", "label", "created_at", "revoked", "hosts_registered"])


@token_app.command("revoke")
def token_revoke(token_id: int, server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    """No new host can register with this token; registered hosts keep working."""
    with _admin(server, admin_token) as http:
        typer.echo(json.dumps(_check(http.post(f"/v1/admin/join-tokens/{token_id}/revoke"))))


@host_app.command("list")
def host_list(server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    with _admin(server, admin_token) as http:
        _print_rows(_check(http.get("/v1/admin/hosts")),
                    ["id", "name", "device", "last_seen", "revoked", "results_valid", "results_failed"])


@host_app.command("revoke")
def host_revoke(host_id: int, server: ServerOpt = "http://127.0.0.1:8000", admin_token: TokenOpt = None) -> None:
    """Refuse a host from now on; its running assignments are dispatched again at once."""
    with _admin(server, admin_token) as http:
        typer.echo(json.dumps(_check(http.post(f"/v1/admin/hosts/{host_id}/revoke"))))


simulate_app = typer.Typer(help="Simulations: a load generator against a running server (the default, or `load`), "
                                  "and a training simulator (`training`).")
app.add_typer(simulate_app, name="simulate")
LoadServerOpt = Annotated[str | None, typer.Option(help="Scheduler URL", show_default=False)]
LoadTokenOpt = Annotated[str | None, typer.Option(help="Join token", show_default=False)]
LoadHostsOpt = Annotated[int, typer.Option(min=1, help="Simulated hosts")]
DurationOpt = Annotated[float, typer.Option(help="Seconds to run at most")]
UntilIdleOpt = Annotated[float | None, typer.Option(help="Stop once no work was handed out for this long")]
ConnectionsOpt = Annotated[int, typer.Option(min=1, help="HTTP connections shared by the hosts")]


@simulate_app.callback(invoke_without_command=True)
def simulate(ctx: typer.Context, server: LoadServerOpt = None, join_token: LoadTokenOpt = None,
             hosts: LoadHostsOpt = 100, duration: DurationOpt = 60.0, until_idle: UntilIdleOpt = None,
             connections: ConnectionsOpt = 100) -> None:
    """Without a subcommand: the load generator, as `simulate load`."""
    if ctx.invoked_subcommand is None:
        simulate_load(server, join_token, hosts, duration, until_idle, connections)


@simulate_app.command("load")
def simulate_load(server: LoadServerOpt = None, join_token: LoadTokenOpt = None, hosts: LoadHostsOpt = 100,
                  duration: DurationOpt = 60.0, until_idle: UntilIdleOpt = None,
                  connections: ConnectionsOpt = 100) -> None:
    """Load generator: simulated hosts that ask for work and upload results without training.

    Prints one line of JSON with the figures (requests/s, work-request latency, dispatches, uploads).
    """
    from crowdtrain.sim.load import simulate as run_simulation

    for value, hint in ((server, "--server"), (join_token, "--join-token")):
        if not value:
            raise typer.BadParameter("required by the load generator", param_hint=hint)
    stats = run_simulation(server, join_token, hosts, duration, until_idle, connections)
    typer.echo(json.dumps(stats.summary()))


@simulate_app.command("training")
def simulate_training(
    spec: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON) to simulate")],
    hosts: Annotated[int, typer.Option(min=1, help="Simulated hosts")] = 8,
    slots: Annotated[int, typer.Option(min=1, help="Task slots per host")] = 1,
    preemption: Annotated[float, typer.Option(min=0, max=0.99, help="Probability p that an assignment is "
                                                                    "preempted")] = 0.0,
    timeout: Annotated[float | None, typer.Option(help="t_o: seconds after dispatch that a lost assignment is "
                                                       "noticed (default: scheduling.deadline_seconds)")] = None,
    network_seconds: Annotated[float, typer.Option(min=0, help="Seconds per transfer (snapshot, shard, "
                                                               "upload)")] = 0.0,
    speed_sigma: Annotated[float, typer.Option(min=0, help="sigma of the hosts' lognormal speed factors")] = 0.5,
    example_seconds: Annotated[float, typer.Option(min=0, help="Compute seconds per example and local epoch "
                                                               "on a speed-1 host")] = 1e-3,
    workunit_seconds: Annotated[float | None, typer.Option(min=0, help="Compute seconds per workunit instead "
                                                                       "(any shard size)")] = None,
    compute: Annotated[bool, typer.Option(help="Train and validate for real; --no-compute: timing only")] = True,
    seed: Annotated[int, typer.Option(help="Seed of host speeds and preemptions")] = 0,
    table: Annotated[bool, typer.Option(help="Also print a table of the main figures")] = False,
) -> None:
    """Training simulator: simulated hosts train the job in this process, on a simulated clock.

    Hosts of lognormal speeds, preemptions, timeouts and transfers are simulated; training, merge
    rules and policy are the real code. Prints one line of JSON (figures, accuracy curve).
    """
    from crowdtrain.core.jobspec import load_job_spec
    from crowdtrain.sim.training import print_table
    from crowdtrain.sim.training import simulate_training as run_training

    try:
        job_spec = load_job_spec(spec)
        result = run_training(job_spec, hosts, slots, preemption, timeout, network_seconds, seed,
                              speed_sigma=speed_sigma, example_seconds=example_seconds,
                              workunit_seconds=workunit_seconds, compute=compute)
    except ValueError as exc:  # pydantic's ValidationError is one too
        raise typer.BadParameter(str(exc), param_hint="SPEC") from None
    if table:
        print_table(result)
    typer.echo(json.dumps(result.summary()))


@app.command()
def demo(
    var_dir: Annotated[Path, typer.Option(help="Where the demo keeps its database, storage and logs")] = Path(
        "var/demo"),
    spec: Annotated[Path | None, typer.Option(help="Job spec to run (default: examples/mnist1d-cnn.yaml, "
                                                   "or examples/mnist1d-dedloc.yaml with --mode dedloc)")] = None,
    clients: Annotated[int, typer.Option(min=1, help="Clients, or peers with --mode dedloc")] = 3,
    tasks: Annotated[int, typer.Option(min=1)] = 2,
    parameter_servers: Annotated[int, typer.Option(min=1)] = 2,
    mode: Annotated[str, typer.Option(help="vc-asgd, or dedloc: synchronous peers (the last one relayed)")] = "vc-asgd",
) -> None:
    """Run the whole system locally on the embedded defaults and train the example job to its target."""
    from crowdtrain.cli.demo import run_dedloc_demo, run_demo

    if mode not in ("vc-asgd", "dedloc"):
        raise typer.BadParameter(f"must be vc-asgd or dedloc, not {mode!r}", param_hint="--mode")
    if mode == "dedloc":
        raise typer.Exit(run_dedloc_demo(var_dir, spec or Path("examples/mnist1d-dedloc.yaml"), clients))
    raise typer.Exit(run_demo(var_dir, spec or Path("examples/mnist1d-cnn.yaml"), clients, tasks, parameter_servers))


# --- spot fleets -------------------------------------------------------------------------------

fleet_app = typer.Typer(help="Spot fleets: EC2 spot instances that each run the client for this project.",
                        no_args_is_help=True)
app.add_typer(fleet_app, name="fleet")

FleetNameOpt = Annotated[str, typer.Option("--name", help="Fleet name; tags every instance crowdtrain:fleet=NAME")]
RegionOpt = Annotated[str | None, typer.Option(help="AWS region (default: the AWS configuration)")]
Ec2EndpointOpt = Annotated[str | None,
                           typer.Option(help="EC2 endpoint (default: CROWDTRAIN_EC2_ENDPOINT_URL, else AWS)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document for scripts instead of a table")]
# FleetSpec fields whose CLI option is named differently.
_FLEET_OPTIONS = {"instance_types": "--instance-types", "subnet_ids": "--subnet-id",
                  "security_group_ids": "--security-group-id"}


def _fleets(region: str | None, endpoint_url: str | None):
    from crowdtrain.fleet.ec2 import Ec2Fleets, ec2_client
    from crowdtrain.core.settings import get_settings

    return Ec2Fleets(ec2_client(region, endpoint_url or get_settings().ec2_endpoint_url))


def _ec2(call):
    """Run `call()`; an EC2 refusal or missing credentials/region ends the command with its message."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        typer.echo("crowdtrain fleet needs boto3: pip install 'crowdtrain[fleet]'", err=True)
        raise typer.Exit(1) from None

    try:
        return call()
    except (BotoCoreError, ClientError) as exc:
        typer.echo(f"EC2: {exc}", err=True)
        raise typer.Exit(1) from None


@fleet_app.command("up")
def fleet_up(
    name: FleetNameOpt,
    count: Annotated[int, typer.Option(help="Spot instances to keep running (>= 1)")],
    instance_types: Annotated[str, typer.Option(help="Comma list, e.g. t3.large,c5.xlarge")],
    image_id: Annotated[str, typer.Option(help="AMI with systemd and Python 3.11+ (Ubuntu 24.04, Amazon Linux 2023)")],
    server: Annotated[str, typer.Option(help="Scheduler URL the clients attach to")],
    join_token: Annotated[str, typer.Option(help="Join token from `crowdtrain admin join-token create`")],
    max_price: Annotated[float | None, typer.Option(help="USD per instance-hour (default: on-demand price)")] = None,
    tasks: Annotated[int, typer.Option(help="Assignments each client runs at once")] = 1,
    client_package: Annotated[str, typer.Option(help="pip requirement installed on every instance")] = (
        "crowdtrain[client]"),
    key_name: Annotated[str | None, typer.Option(help="EC2 key pair for SSH")] = None,
    subnet_id: Annotated[str | None,
                         typer.Option(help="Subnet(s), comma list; several zones find more capacity")] = None,
    security_group_id: Annotated[str | None, typer.Option(help="Security group(s), comma list")] = None,
    allocation_strategy: Annotated[str, typer.Option(help="price-capacity-optimized, capacity-optimized, "
                                                          "lowest-price or diversified")] = "price-capacity-optimized",
    region: RegionOpt = None,
    endpoint_url: Ec2EndpointOpt = None,
) -> None:
    """Request COUNT spot instances; each installs the client and attaches it to SERVER.
    EC2 keeps COUNT running, replacing preempted ones, until `fleet down`."""
    from pydantic import ValidationError

    from crowdtrain.fleet.spec import FleetSpec
    from crowdtrain.fleet.ec2 import FleetExists

    try:
        spec = FleetSpec(name=name, count=count, instance_types=instance_types, max_price=max_price,
                         image_id=image_id, server=server, join_token=join_token, tasks=tasks,
                         client_package=client_package, key_name=key_name, subnet_ids=subnet_id or [],
                         security_group_ids=security_group_id or [], allocation_strategy=allocation_strategy)
    except ValidationError as exc:
        for error in exc.errors():
            option = _FLEET_OPTIONS.get(str(error["loc"][0]), "--" + str(error["loc"][0]).replace("_", "-"))
            typer.echo(f"invalid {option}: {error['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(2) from None
    try:
        fleet_id = _ec2(lambda: _fleets(region, endpoint_url).up(spec))
    except FleetExists as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    price = f"{spec.max_price_text} USD/h" if spec.max_price_text else "the on-demand price"
    typer.echo(f"fleet {spec.name}: requested {spec.count} spot instance(s) of {', '.join(spec.instance_types)} "
               f"at up to {price} ({fleet_id}); clients attach to {spec.server}")


def _fleet_hosts(server: str | None, admin_token: str | None) -> tuple[list[dict], str | None]:
    """The scheduler's hosts, or why they could not be read: status still shows the instances."""
    import httpx

    if not server:
        return [], "no scheduler URL: pass --server"
    try:
        with _admin(server, admin_token) as http:
            resp = http.get("/v1/admin/hosts")
    except httpx.HTTPError as exc:
        return [], f"{server} unreachable: {exc}"
    if resp.status_code >= 400:
        return [], f"{server} answered {resp.status_code}: {resp.text[:200]}"
    return resp.json(), None


def _minute(t) -> str:
    return t.strftime("%Y-%m-%d %H:%M") if t else "-"


@fleet_app.command("status")
def fleet_status(
    name: FleetNameOpt,
    server: Annotated[str | None,
                      typer.Option(help="Scheduler URL (default: the one the fleet was started with)")] = None,
    admin_token: TokenOpt = None,
    as_json: JsonOpt = False,
    region: RegionOpt = None,
    endpoint_url: Ec2EndpointOpt = None,
) -> None:
    """The fleet's instances, each with the host its client registered as on the scheduler."""
    from crowdtrain.fleet.spec import attach_hosts

    fleets = _ec2(lambda: _fleets(region, endpoint_url))
    requests = [{"fleet_id": f["FleetId"], "state": f["FleetState"],
                 "target_capacity": f["TargetCapacitySpecification"]["TotalTargetCapacity"],
                 "fulfilled_capacity": f.get("FulfilledCapacity")} for f in _ec2(lambda: fleets.fleets(name))]
    instances = _ec2(lambda: fleets.instances(name))
    server = server or _ec2(lambda: fleets.server_url(name))
    hosts, hosts_error = _fleet_hosts(server, admin_token)
    rows = attach_hosts(instances, hosts)
    if as_json:
        typer.echo(json.dumps({"fleet": name, "server": server, "requests": requests, "hosts_error": hosts_error,
                               "instances": [r.model_dump(mode="json") for r in rows]}))
        return
    if hosts_error:
        typer.echo(f"hosts unknown: {hosts_error}", err=True)
    if not requests and not rows:
        typer.echo(f"fleet {name}: no such fleet here (check --region)")
        return
    for r in requests:
        typer.echo(f"{r['fleet_id']}: {r['state']}, {r['fulfilled_capacity']}/{r['target_capacity']} running")
    _print_rows([{"instance": r.instance_id, "type": r.instance_type, "state": r.state,
                  "lifecycle": r.lifecycle, "zone": r.availability_zone, "spot price": r.spot_price,
                  "max price": r.max_price or "on-demand", "launched": _minute(r.launch_time),
                  "host": r.host.id if r.host else "-", "last seen": _minute(r.host.last_seen) if r.host else "-",
                  "results valid": r.host.results_valid if r.host else "-"} for r in rows],
                ["instance", "type", "state", "lifecycle", "zone", "spot price", "max price", "launched", "host",
                 "last seen", "results valid"])


@fleet_app.command("down")
def fleet_down(name: FleetNameOpt, as_json: JsonOpt = False, region: RegionOpt = None,
               endpoint_url: Ec2EndpointOpt = None) -> None:
    """Cancel the fleet's requests and terminate its instances. Safe to run again."""
    done = _ec2(lambda: _fleets(region, endpoint_url).down(name))
    if as_json:
        typer.echo(json.dumps({"fleet": name, "fleets_deleted": done.fleets_deleted,
                               "requests_cancelled": done.requests_cancelled,
                               "instances_terminated": [i.model_dump(mode="json") for i in done.instances_terminated],
                               "template_deleted": done.template_deleted}))
        return
    for fleet_id in done.fleets_deleted:
        typer.echo(f"deleted EC2 fleet {fleet_id}")
    for request_id in done.requests_cancelled:
        typer.echo(f"cancelled spot request {request_id}")
    for i in done.instances_terminated:
        typer.echo(f"terminated {i.instance_id} ({i.instance_type}, was {i.state})")
    if done.template_deleted:
        typer.echo(f"deleted launch template {done.template_deleted}")
    if not (done.fleets_deleted or done.requests_cancelled or done.instances_terminated or done.template_deleted):
        typer.echo(f"fleet {name}: nothing left to take down")


if __name__ == "__main__":
    app()
