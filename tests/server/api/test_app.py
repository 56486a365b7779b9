"""The scheduler application (crowdtrain.server.api.app)."""

import os
import subprocess
import sys

from tests.server.inprocess import scheduler_app


def test_a_scheduler_process_says_when_it_starts_serving(tmp_path, private_redis, capfd) -> None:
    """uvicorn's own startup lines are below the scheduler's log level: this line is how one knows that
    a scheduler worker its supervisor started again after a crash is back."""
    with scheduler_app(tmp_path, private_redis) as sched:
        assert sched.http.get("/v1/health/live").status_code == 200
    assert f"scheduler process {os.getpid()} serving" in capfd.readouterr().err


def test_scheduler_and_transitioner_processes_start_without_loading_a_framework() -> None:
    """Each scheduler worker and the transitioner import their code without torch or tensorflow: those
    load on the first job submission or evaluation, in the process that needs them."""
    probe = (
        "import sys, crowdtrain.server.api.app, crowdtrain.server.services.transitioner; "
        "print(sorted(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
