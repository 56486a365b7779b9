"""`crowdtrain assimilator`: a parameter server, its Celery worker restarted if it dies.

The supervising process imports none of the server's packages: it only starts and restarts the worker
(`crowdtrain assimilator-worker`, crowdtrain.cli.processes), which holds them. Without supervision this
process becomes the worker (exec), keeping its pid.
"""

import os
import sys
from typing import Annotated

import typer

from crowdtrain.cli.options import HELP_LAYOUT, configure_logging
from crowdtrain.launch.supervise import supervise as run_supervised

app = typer.Typer(add_completion=False, **HELP_LAYOUT)


def worker_argv(concurrency: int) -> list[str]:
    """The command line of the parameter server's Celery worker."""
    return [sys.executable, "-m", "crowdtrain", "assimilator-worker", "--concurrency", str(concurrency)]


@app.command()
def assimilator(
    concurrency: Annotated[int, typer.Option(min=1)] = 1,
    supervise: Annotated[
        bool, typer.Option("--supervise/--no-supervise", help="Restart the Celery worker if it dies")
    ] = True,
) -> None:
    """Run a parameter server: a Celery worker with `concurrency` processes, restarted if it dies."""
    argv = worker_argv(concurrency)
    if not supervise:
        os.execv(argv[0], argv)
    configure_logging()
    raise typer.Exit(run_supervised(argv, "the parameter server's Celery worker"))
