"""The scheduler application (crowdtrain.server.api.app)."""

import os

from tests.server.inprocess import scheduler_app


def test_a_scheduler_process_says_when_it_starts_serving(tmp_path, private_redis, capfd) -> None:
    """uvicorn's own startup lines are below the scheduler's log level: this line is how one knows that
    a scheduler worker its supervisor started again after a crash is back."""
    with scheduler_app(tmp_path, private_redis) as sched:
        assert sched.http.get("/v1/health").status_code == 200
    assert f"scheduler process {os.getpid()} serving" in capfd.readouterr().err
