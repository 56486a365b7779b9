"""`crowdtrain demo`: the whole system on one machine, trained to the example job's target."""

import shutil
import signal
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from crowdtrain.cli.options import HELP_LAYOUT
from crowdtrain.cli.plot import plot_accuracy
from crowdtrain.cli.progress import watch
from crowdtrain.core.jobspec import MOE, load_job_spec
from crowdtrain.core.schemas_jobs import BEST_LABEL, JobStatusOut, best_closed_epoch
from crowdtrain.launch.cluster import CLIENT_GRACE, Cluster

DEMO_TIMEOUT = 600
# The example specs live in the repository's examples/ folder, found from this module rather than from
# the working directory, so that `crowdtrain demo` runs from anywhere in a checkout (or editable install).
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO_SPECS = {"vc-asgd": "mnist1d-cnn.yaml", "dedloc": "mnist1d-dedloc.yaml", "moe": "clusters-moe.yaml"}
EXPERTS_LEASED_TIMEOUT = 120  # seconds the moe demo waits for its expert hosts to lease every expert
# Each mode keeps its output in a folder of its own, which a run empties first: one demo never deletes
# the other's.
DEMO_VAR = Path("var/demo")

app = typer.Typer(add_completion=False, **HELP_LAYOUT)


@app.command()
def demo(
    var_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where the demo keeps its database, storage and logs, emptied first (default var/demo/MODE)",
            show_default=False,
        ),
    ] = None,
    spec: Annotated[
        Path | None,
        typer.Option(
            help="Job spec to run (default: the repository's examples/mnist1d-cnn.yaml, "
            "examples/mnist1d-dedloc.yaml with --mode dedloc, examples/clusters-moe.yaml with --mode moe)",
            show_default=False,
        ),
    ] = None,
    clients: Annotated[
        int | None,
        typer.Option(min=1, help="Clients, or peers with --mode dedloc [default: 3; 1 trainer with --mode moe]"),
    ] = None,
    expert_hosts: Annotated[int, typer.Option(min=1, help="--mode moe: expert hosts serving the experts")] = 3,
    tasks: Annotated[int, typer.Option(min=1, help="Task slots of each client")] = 2,
    parameter_servers: Annotated[int, typer.Option(min=1, help="Celery worker processes merging results")] = 2,
    mode: Annotated[
        str,
        typer.Option(
            help="vc-asgd; dedloc: synchronous peers (the last one relayed); or moe: expert-parallel, the experts "
            "on expert hosts and the trunk trained by the clients"
        ),
    ] = "vc-asgd",
    keep: Annotated[
        bool,
        typer.Option(
            "--keep/--no-keep",
            help="After the job ends, stop the clients but leave the scheduler, Redis, parameter servers and "
            "transitioner running (the dashboard stays up) until Ctrl-C",
        ),
    ] = False,
) -> None:
    """Run the whole system locally on the embedded defaults and train the example job to its target."""
    if mode not in DEMO_SPECS:
        raise typer.BadParameter(f"must be one of {', '.join(DEMO_SPECS)}, not {mode!r}", param_hint="--mode")
    var_dir = var_dir or DEMO_VAR / mode
    spec = spec or _example_spec(mode)
    if mode == "dedloc":
        raise typer.Exit(run_dedloc_demo(var_dir, spec, clients or 3, keep))
    hosts = expert_hosts if mode == MOE else 0
    default_clients = 1 if mode == MOE else 3
    raise typer.Exit(run_demo(var_dir, spec, clients or default_clients, tasks, parameter_servers, keep, hosts))


def _example_spec(mode: str) -> Path:
    """The example spec of `mode`; exit 2 saying to pass --spec where the examples are not installed."""
    path = EXAMPLES / DEMO_SPECS[mode]
    if not path.is_file():
        typer.echo(f"{path} does not exist (the examples come with the source repository): pass --spec", err=True)
        raise typer.Exit(2)
    return path


def locality_figures(http) -> dict[str, float]:
    """Shard-locality counters from the scheduler's /metrics: what clients' caches saved."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "crowdtrain_dispatches_total",
        "crowdtrain_dispatches_cached_shard_total",
        "crowdtrain_shard_bytes_saved_total",
        "crowdtrain_shard_bytes_sent_total",
    }
    resp = http.get("/metrics")
    resp.raise_for_status()
    return {
        s.name: s.value for fam in text_string_to_metric_families(resp.text) for s in fam.samples if s.name in wanted
    }


def _locality_row(f: dict[str, float]) -> str:
    saved, sent = f.get("crowdtrain_shard_bytes_saved_total", 0), f.get("crowdtrain_shard_bytes_sent_total", 0)
    return (
        f"{int(f.get('crowdtrain_dispatches_cached_shard_total', 0))} of "
        f"{int(f.get('crowdtrain_dispatches_total', 0))} assignments had their shard cached: "
        f"{saved / 1e6:.2f} MB not downloaded, {sent / 1e6:.2f} MB downloaded"
    )


def summary_table(st: JobStatusOut, wall: float, locality: dict[str, float] | None = None) -> Table:
    t = Table(title="crowdtrain demo summary", show_header=False)
    best = best_closed_epoch(st.epochs)
    rows = [
        ("job", f"{st.job_id} {st.name}"),
        ("status", st.status),
        ("reason", st.status_message),
        ("epochs", str(st.current_epoch)),
        ("merges", str(st.merges)),
        (BEST_LABEL, f"{best.mean_accuracy:.4f} (epoch {best.epoch})" if best is not None else "-"),
        ("final W_s accuracy", f"{st.final_accuracy:.4f}" if st.final_accuracy is not None else "-"),
        ("assignments", ", ".join(f"{k} {v}" for k, v in sorted(st.assignments.items()))),
        ("wall time", f"{wall:.1f}s"),
    ]
    if locality is not None:
        rows.append(("shard locality", _locality_row(locality)))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _interrupt(signum, frame) -> None:
    """SIGTERM is handled like Ctrl-C: the demo stops every process it started."""
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM stop the demo and every process it started, however it was started:
    a shell without job control starts a background command with SIGINT ignored, and Python then
    never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def _print_login(console: Console, cluster: Cluster) -> None:
    """Where the dashboard is and the admin token it takes (random for each demo)."""
    console.print(
        f"dashboard: {cluster.url}/dashboard/login  admin token: {cluster.admin_token}", soft_wrap=True, highlight=False
    )


def _keep_running(console: Console, cluster: Cluster, code: int) -> int:
    """`--keep`: stop the clients, leave the server side running until Ctrl-C (or SIGTERM), then return
    the job's exit code `code`; the caller stops the rest."""
    for client in cluster.clients:
        client.signal(signal.SIGTERM)
    for client in cluster.clients:
        client.stop(CLIENT_GRACE)
    _print_login(console, cluster)
    console.print(
        f"the scheduler, Redis, parameter servers and transitioner are left running at {cluster.url}; "
        "press Ctrl-C to stop them",
        soft_wrap=True,
        highlight=False,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("stopping the scheduler, Redis, parameter servers and transitioner")
    return code


def run_demo(
    var_dir: Path,
    spec_path: Path,
    clients: int,
    tasks: int,
    parameter_servers: int,
    keep: bool = False,
    expert_hosts: int = 0,
) -> int:
    """The scheduler, its parameter servers and `clients` clients training the spec's job; for a mode
    moe job, `expert_hosts` expert hosts serving its experts first."""
    console = Console()
    spec = load_job_spec(spec_path)
    if (spec.mode == MOE) != (expert_hosts > 0):
        console.print(f"[red]{spec_path} is a {spec.mode} job: --mode moe runs a moe spec, the others none")
        return 2
    if var_dir.exists():
        shutil.rmtree(var_dir)
    start = time.monotonic()
    cluster = Cluster(var_dir=var_dir.resolve(), assimilator_concurrency=parameter_servers)
    _stop_on_signals()
    try:
        console.print(f"starting Redis, scheduler, transitioner, {parameter_servers} parameter servers ...")
        cluster.start()
        _print_login(console, cluster)
        console.print(f"scheduler at {cluster.url}; submitting {spec_path} ({spec.name})")
        with cluster.admin() as http:
            resp = http.post("/v1/jobs", json=spec.model_dump(mode="json"))
            if resp.status_code >= 400:
                console.print(f"[red]job rejected: {resp.text}")
                return 2
            job_id = resp.json()["job_id"]
            if expert_hosts and not _serve_experts(console, http, cluster, job_id, expert_hosts):
                return 1
            console.print(f"starting {clients} clients with {tasks} task slots each")
            for i in range(clients):
                cluster.start_client(f"client-{i + 1}", tasks)
            st = watch(
                http,
                job_id,
                timeout=DEMO_TIMEOUT,
                alive=lambda: all(s.alive for s in cluster.services) and any(c.alive for c in cluster.clients),
            )
            final = JobStatusOut.model_validate(http.get(f"/v1/jobs/{job_id}", params={"metrics": True}).json())
            locality = locality_figures(http)
        png = plot_accuracy(final, var_dir / "accuracy.png")
        console.print()
        console.print(summary_table(final, time.monotonic() - start, locality))
        console.print(f"accuracy plot: {png}; logs: {var_dir / 'logs'}")
        code = 0
        if st.status != "succeeded":
            dead = [s.name for s in cluster.services if not s.alive]
            console.print(
                f"[red]the job did not reach its target ({st.status})"
                + (f"; stopped processes: {dead}" if dead else "")
            )
            code = 1
        return _keep_running(console, cluster, code) if keep else code
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping every process")
        return 130
    finally:
        cluster.stop()


def _serve_experts(console: Console, http, cluster: Cluster, job_id: int, hosts: int) -> bool:
    """Start `hosts` expert hosts for the moe job and wait until they serve every expert. Each may take
    twice its share, so that the others can take over a host's experts when it goes."""
    mixture = http.get(f"/v1/jobs/{job_id}").json()["mixture_id"]
    experts = len(http.get(f"/v1/mixtures/{mixture}").json()["experts"])
    capacity = -(-2 * experts // hosts)
    console.print(f"starting {hosts} expert hosts for the {experts} experts of mixture {mixture}")
    for i in range(hosts):
        cluster.start_expert_host(f"expert-host-{i + 1}", mixture, capacity)
    deadline = time.monotonic() + EXPERTS_LEASED_TIMEOUT
    served = 0
    while time.monotonic() < deadline:
        served = http.get(f"/v1/mixtures/{mixture}").json()["served"]
        if served == experts:
            console.print(f"every expert is served ({experts})")
            return True
        time.sleep(0.5)
    console.print(f"[red]only {served} of {experts} experts were served after {EXPERTS_LEASED_TIMEOUT}s")
    return False


def run_dedloc_demo(var_dir: Path, spec_path: Path, peers: int, keep: bool = False) -> int:
    """`crowdtrain demo --mode dedloc`: the scheduler and `peers` DeDLOC peers, the last one relayed
    (it declares that it cannot accept connections, so the scheduler reduces for it)."""
    console = Console()
    spec = load_job_spec(spec_path)
    if spec.mode != "dedloc" or spec.dedloc is None:  # JobSpec has the dedloc section in dedloc mode only
        console.print(f"[red]{spec_path} is a {spec.mode} job; --mode dedloc needs a dedloc spec")
        return 2
    if var_dir.exists():
        shutil.rmtree(var_dir)
    start = time.monotonic()
    cluster = Cluster(var_dir=var_dir.resolve(), assimilator_concurrency=1)
    _stop_on_signals()
    try:
        console.print("starting Redis and the scheduler ...")
        cluster.start()
        _print_login(console, cluster)
        with cluster.admin() as http:
            resp = http.post("/v1/jobs", json=spec.model_dump(mode="json"))
            if resp.status_code >= 400:
                console.print(f"[red]job rejected: {resp.text}")
                return 2
            job_id = resp.json()["job_id"]
            console.print(
                f"job {job_id} ({spec.name}): {peers} peers, target batch {spec.dedloc.target_batch_size}, "
                f"target accuracy {spec.stop.target_accuracy}"
            )
            for i in range(peers):
                relayed = ["--relayed"] if i == peers - 1 else []
                cluster.start_peer(f"peer-{i + 1}", job_id, "--data-rank", str(i), "--data-world", str(peers), *relayed)
            st = _follow_steps(console, http, job_id, cluster)
            # The job ends with the first upload of its final state; the other members still apply
            # that step and report their parameters' digest before they learn that it has ended.
            for peer in cluster.clients:
                if peer.proc is not None:  # returns at once for a peer that has exited
                    peer.proc.wait(timeout=60)
            commits = http.get(f"/v1/dedloc/jobs/{job_id}/commits").json()
            digests = http.get(f"/v1/dedloc/jobs/{job_id}/digests/{st.param_version}").json()
        t = Table(title="crowdtrain dedloc demo summary", show_header=False)
        sizes = [len(c["members"]) for c in commits.values()]
        examples = [sum(c["examples"].values()) for c in commits.values()]
        for k, v in [
            ("job", f"{st.job_id} {st.name}"),
            ("status", st.status),
            ("reason", st.status_message),
            ("global steps", str(st.param_version)),
            ("final accuracy", f"{st.final_accuracy:.4f}" if st.final_accuracy is not None else "-"),
            ("members per step", f"min {min(sizes, default=0)}, max {max(sizes, default=0)}"),
            ("examples per step", f"min {min(examples, default=0)}, max {max(examples, default=0)}"),
            ("retried steps", str(sum(1 for c in commits.values() if c["attempt"] > 0))),
            ("peers' final parameters", f"{len(digests)} peers, {len(set(digests.values()))} distinct digest(s)"),
            ("wall time", f"{time.monotonic() - start:.1f}s"),
        ]:
            t.add_row(k, v)
        console.print(t)
        console.print(f"logs: {var_dir / 'logs'}")
        code = 0 if st.status == "succeeded" else 1
        return _keep_running(console, cluster, code) if keep else code
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; stopping every process")
        return 130
    finally:
        cluster.stop()


def _follow_steps(console: Console, http, job_id: int, cluster: Cluster) -> JobStatusOut:
    shown = 0
    deadline = time.monotonic() + DEMO_TIMEOUT
    while True:
        st = JobStatusOut.model_validate(http.get(f"/v1/jobs/{job_id}", params={"metrics": True}).json())
        for m in st.metrics[shown:]:
            console.print(
                f"step {m.param_version:4d}  validation accuracy {m.val_accuracy:.4f}  "
                f"loss {m.val_loss:.4f}  t {m.t:6.1f}s"
            )
        shown = len(st.metrics)
        if st.status in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
            return st
        if not any(p.alive for p in cluster.clients):
            console.print("[red]every peer has exited")
            return st
        time.sleep(1.0)
