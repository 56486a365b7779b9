"""The `crowdtrain` command line. Each command only moves data in and out of the services.

One module per command group; this root imports none of them. A command's module is imported when
the command runs, so a client-only install (no server packages) still runs `crowdtrain --help` and
`crowdtrain client`. The root's help lists each command with the help text kept here, which a test
holds equal to the command's own.
"""

import sys

import typer

from crowdtrain.cli.errors import report
from crowdtrain.cli.lazy import LazyCommand, LazyGroup

_PROCESSES = "crowdtrain.cli.processes"
# The packages each command imports beyond the base install (crowdtrain.cli.errors.EXTRA_OF names
# their extras): a command this install cannot run is left out of the help and explained if run.
_SERVER = ("sqlalchemy", "uvicorn", "celery", "redis")  # sqlalchemy first: uvicorn alone is the experts' extra
_CLIENT = ("httpx", "torch")
COMMANDS = {
    "migrate": LazyCommand(
        _PROCESSES,
        "Bring the database to the latest schema (`alembic upgrade head`) and exit.",
        member="migrate",
        needs=_SERVER,
    ),
    "server": LazyCommand(
        _PROCESSES,
        "Run the scheduler (it needs CROWDTRAIN_ADMIN_TOKEN; CROWDTRAIN_JOIN_TOKEN is optional).",
        member="server",
        needs=_SERVER,
    ),
    "assimilator": LazyCommand(
        "crowdtrain.cli.assimilator",
        "Run a parameter server: a Celery worker with `concurrency` processes, restarted if it dies.",
        needs=_SERVER,
    ),
    "assimilator-worker": LazyCommand(
        _PROCESSES,
        "The Celery worker of a parameter server (`crowdtrain assimilator` starts and supervises it).",
        member="assimilator-worker",
        needs=_SERVER,
        hidden=True,
    ),
    "transitioner": LazyCommand(
        _PROCESSES,
        "Run the transitioner loop: deadlines, retries, stalled merges.",
        member="transitioner",
        needs=_SERVER,
    ),
    "peer": LazyCommand(
        "crowdtrain.cli.peer", "Run a peer of a synchronous DeDLOC job until the job finishes.", needs=_CLIENT
    ),
    "expert-host": LazyCommand(
        "crowdtrain.cli.experts",
        "Serve experts of a mixture-of-experts model (expert-parallel training) over HTTP.",
        needs=("torch", "uvicorn"),
    ),
    "mixture": LazyCommand(
        "crowdtrain.cli.mixtures",
        "Expert-parallel training's mixtures: create one, see its experts (needs the admin token).",
        needs=("httpx",),
    ),
    "demo": LazyCommand(
        "crowdtrain.cli.demo",
        "Run the whole system locally on the embedded defaults and train the example job to its target.",
        needs=_SERVER,
    ),
    "job": LazyCommand(
        "crowdtrain.cli.jobs", "Submit and follow training jobs (needs the admin token).", needs=("httpx",)
    ),
    "admin": LazyCommand(
        "crowdtrain.cli.admin",
        "Operator commands: join tokens, hosts and the project key (needs the admin token).",
        needs=("httpx", "cryptography"),
    ),
    "client": LazyCommand(
        "crowdtrain.cli.client", "The volunteer client: run it, or see what it is doing.", needs=_CLIENT
    ),
    "simulate": LazyCommand(
        "crowdtrain.cli.simulate",
        "Simulations: a load generator against a running server "
        "(the default, or `load`), and a training simulator "
        "(`training`).",
        needs=_SERVER,
    ),
    "health": LazyCommand(
        "crowdtrain.cli.health",
        "The deployment's health: database, Redis, storage and each kind of process (GET /v1/health).",
        needs=("httpx",),
    ),
    "fleet": LazyCommand(
        "crowdtrain.cli.fleet",
        "Spot fleets: EC2 spot instances that each run the client for this project.",
        needs=("boto3", "httpx"),
    ),
}


class Commands(LazyGroup):
    lazy_commands = COMMANDS


app = typer.Typer(
    cls=Commands,
    help="crowdtrain: train deep-learning models on compute that comes and goes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Every command's help shows its options' defaults (each command module lays its help out with
    # crowdtrain.cli.options.HELP_LAYOUT); this root keeps typer's panel listing the commands.
    context_settings={"show_default": True},
)


@app.callback()
def crowdtrain(
    debug: bool = typer.Option(
        False, "--debug", help="Show an error's traceback instead of its message (or set CROWDTRAIN_DEBUG=1)"
    ),
) -> None:
    # Typer makes a group only of an app with a callback or commands of its own; the commands are COMMANDS.
    # `--debug` is read by `main`, which runs this app.
    pass


def main() -> None:
    """The `crowdtrain` command: this app, its users' mistakes explained (crowdtrain.cli.errors)."""
    try:
        app(prog_name="crowdtrain")
    except Exception as exc:
        code = report(exc, sys.argv[1:])
        if code is None:
            raise
        sys.exit(code)
