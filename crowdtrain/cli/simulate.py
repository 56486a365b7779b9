"""`crowdtrain simulate`: the load generator (simulated hosts against a running server) and the training
simulator (simulated hosts training a job in this process, on a simulated clock)."""

import json
from pathlib import Path
from typing import Annotated

import typer

from crowdtrain.cli.options import HELP_LAYOUT, JOIN_TOKEN_ENV, ArgumentsCommand, OptionalServerOpt
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.sim.hosts import WORK_RETRY_AFTER
from crowdtrain.sim.load import simulate as run_simulation
from crowdtrain.sim.result import print_table
from crowdtrain.sim.servers import EVAL_SECONDS, MERGE_SECONDS, PASS_SECONDS
from crowdtrain.sim.training import simulate_training as run_training

app = typer.Typer(
    name="simulate",
    help="Simulations: a load generator against a running server (the default, or "
    "`load`), and a training simulator (`training`).",
    add_completion=False,
    **HELP_LAYOUT,
)
LoadTokenOpt = Annotated[
    str | None, typer.Option(envvar=JOIN_TOKEN_ENV, show_envvar=True, help="Join token", show_default=False)
]
LoadHostsOpt = Annotated[int, typer.Option(min=1, help="Simulated hosts")]
DurationOpt = Annotated[
    float, typer.Option(help="Seconds to run at most (SIGTERM or Ctrl-C ends it sooner, with the figures)")
]
UntilIdleOpt = Annotated[
    float | None,
    typer.Option(help="Stop once no work was handed out for this long (default: run --duration)", show_default=False),
]
ConnectionsOpt = Annotated[int, typer.Option(min=1, help="HTTP connections shared by the hosts")]
TrainSecondsOpt = Annotated[
    float,
    typer.Option(min=0, help="Seconds each host holds a workunit before uploading, heartbeating as a client does"),
]


@app.callback(invoke_without_command=True)
def simulate(
    ctx: typer.Context,
    server: OptionalServerOpt = None,
    join_token: LoadTokenOpt = None,
    hosts: LoadHostsOpt = 100,
    duration: DurationOpt = 60.0,
    until_idle: UntilIdleOpt = None,
    connections: ConnectionsOpt = 100,
    train_seconds: TrainSecondsOpt = 0.0,
) -> None:
    """Without a subcommand: the load generator, as `simulate load`."""
    if ctx.invoked_subcommand is None:
        simulate_load(server, join_token, hosts, duration, until_idle, connections, train_seconds)


@app.command("load")
def simulate_load(
    server: OptionalServerOpt = None,
    join_token: LoadTokenOpt = None,
    hosts: LoadHostsOpt = 100,
    duration: DurationOpt = 60.0,
    until_idle: UntilIdleOpt = None,
    connections: ConnectionsOpt = 100,
    train_seconds: TrainSecondsOpt = 0.0,
) -> None:
    """Load generator: simulated hosts that ask for work and upload results without training (or
    after holding each workunit --train-seconds, heartbeating as a client does).

    Prints one line of JSON with the figures (requests/s, work-request latency, dispatches, uploads,
    heartbeats).
    """
    if not server:
        raise typer.BadParameter("required by the load generator", param_hint="--server")
    if not join_token:
        raise typer.BadParameter("required by the load generator", param_hint="--join-token")
    stats = run_simulation(server, join_token, hosts, duration, until_idle, connections, train_seconds)
    typer.echo(json.dumps(stats.summary()))


@app.command("training", cls=ArgumentsCommand)
def simulate_training(
    spec: Annotated[
        Path, typer.Argument(metavar="SPEC", help="Job spec (YAML or JSON) to simulate", show_default=False)
    ],
    hosts: Annotated[int, typer.Option(min=1, help="Simulated hosts")] = 8,
    slots: Annotated[int, typer.Option(min=1, help="Task slots per host")] = 1,
    preemption: Annotated[
        float, typer.Option(min=0, max=0.99, help="Probability p that an assignment is preempted")
    ] = 0.0,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="t_o: seconds after dispatch that a lost assignment is noticed (default: scheduling.deadline_seconds)"
        ),
    ] = None,
    network_seconds: Annotated[float, typer.Option(min=0, help="Seconds per transfer (snapshot, shard, upload)")] = 0.0,
    speed_sigma: Annotated[float, typer.Option(min=0, help="sigma of the hosts' lognormal speed factors")] = 0.5,
    jitter_sigma: Annotated[
        float, typer.Option(min=0, help="sigma of each assignment's lognormal compute-time factor around its host's")
    ] = 0.0,
    example_seconds: Annotated[
        float, typer.Option(min=0, help="Compute seconds per example and local epoch on a speed-1 host")
    ] = 1e-3,
    workunit_seconds: Annotated[
        float | None,
        typer.Option(min=0, help="Compute seconds per workunit instead (any shard size)", show_default=False),
    ] = None,
    compute: Annotated[bool, typer.Option(help="Train and validate for real; --no-compute: timing only")] = True,
    prefetch: Annotated[
        bool, typer.Option(help="Hosts hold slots + 1 assignments, as the client does; --no-prefetch: slots")
    ] = True,
    merge_seconds: Annotated[
        float, typer.Option(min=0, help="Seconds a merge pass takes per result in it")
    ] = MERGE_SECONDS,
    pass_seconds: Annotated[
        float, typer.Option(min=0, help="Seconds a merge pass takes besides its results (one pass at a time)")
    ] = PASS_SECONDS,
    eval_seconds: Annotated[
        float, typer.Option(min=0, help="Seconds a parameter server takes per evaluation (every eval_every merges)")
    ] = EVAL_SECONDS,
    parameter_servers: Annotated[int, typer.Option(min=1, help="Parameter-server processes serving the job")] = 1,
    retry_after: Annotated[
        float,
        typer.Option(
            min=0, help="Seconds a host given no work waits before asking again, unless a slot frees (0: none)"
        ),
    ] = WORK_RETRY_AFTER,
    keep_optimizer_state: Annotated[
        bool,
        typer.Option(help="Each host's slots carry their optimizer state from one workunit to the next"),
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of host speeds, preemptions and jitter")] = 0,
    table: Annotated[bool, typer.Option(help="Also print a table of the main figures")] = False,
) -> None:
    """Training simulator: simulated hosts train the job in this process, on a simulated clock.

    Hosts of lognormal speeds, preemptions, timeouts and transfers, and the parameter servers' queue,
    are simulated; training, merge rules and policy are the real code. Prints one line of JSON
    (figures, accuracy curve).
    """
    try:
        job_spec = load_job_spec(spec)
        result = run_training(
            job_spec,
            hosts,
            slots,
            preemption,
            timeout,
            network_seconds,
            seed,
            speed_sigma=speed_sigma,
            jitter_sigma=jitter_sigma,
            retry_after=retry_after,
            example_seconds=example_seconds,
            workunit_seconds=workunit_seconds,
            compute=compute,
            prefetch=prefetch,
            merge_seconds=merge_seconds,
            eval_seconds=eval_seconds,
            pass_seconds=pass_seconds,
            parameter_servers=parameter_servers,
            keep_optimizer_state=keep_optimizer_state,
        )
    except ValueError as exc:  # pydantic's ValidationError is one too
        raise typer.BadParameter(str(exc), param_hint="SPEC") from None
    if table:
        print_table(result)
    typer.echo(json.dumps(result.summary()))
