"""`crowdtrain server --workers N`: a worker process that is alive but slow to answer its supervisor's
ping (its GIL held by a long computation, or the machine loaded) keeps serving; it is not killed."""

import contextlib
import os
import signal
import time

import httpx
import pytest

from crowdtrain.cli.processes import WORKER_HEALTHCHECK_S

pytestmark = pytest.mark.integration

# uvicorn's own default: a worker that did not answer a ping within 5 s was killed, with its requests.
UVICORN_DEFAULT_HEALTHCHECK_S = 5
UNRESPONSIVE_S = UVICORN_DEFAULT_HEALTHCHECK_S + 3


def test_a_worker_that_answers_its_supervisor_late_is_not_killed(make_cluster) -> None:
    assert WORKER_HEALTHCHECK_S > UNRESPONSIVE_S
    cluster = make_cluster(server_workers=2)
    workers = cluster.scheduler_workers()
    assert len(workers) == 2, workers
    slow = workers[0]
    # A stopped process answers nothing, as a worker whose GIL is held for that long; the supervisor
    # pings each worker every half second.
    os.kill(slow, signal.SIGSTOP)
    try:
        time.sleep(UNRESPONSIVE_S)  # the supervisor's clock, which the test cannot pass in
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed: the assertion below says so
            os.kill(slow, signal.SIGCONT)
    assert sorted(cluster.scheduler_workers()) == sorted(workers), cluster.service("server").tail()
    assert httpx.get(f"{cluster.url}/v1/health/live", timeout=10).status_code == 200
