"""The scheduler's transport as `crowdtrain server` serves it: a real uvicorn process.

A client reuses a pooled keep-alive connection for up to its pool's expiry (httpx: 5 s). If the
scheduler may close an idle connection sooner or as soon (uvicorn's default keep-alive is 5 s too,
counted from when the server sent its answer), a request sent on it just then is lost:
"Server disconnected without sending a response". Under load the window widens: uvicorn's loop
(uvloop) runs its expired timers before it reads the sockets, so a scheduler that did not run for 5 s
closes a connection whose next request has been waiting since long before.
"""

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv, free_port, start_redis, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[str, Service]]:
    """Only the scheduler process (and the private Redis it is configured with), on SQLite."""
    redis_port = free_port()
    redis_svc = start_redis(tmp_path / "redis", redis_port)
    cluster = Cluster(var_dir=tmp_path / "var", redis_url=f"redis://127.0.0.1:{redis_port}/0", port=free_port())
    argv = crowdtrain_argv("server", "--port", str(cluster.port))
    server = Service("server", argv, cluster.env, tmp_path / "server.log").start()
    try:
        wait_for(lambda: _healthy(cluster.url), 120, "the scheduler did not come up", server)
        yield cluster.url, server
    finally:
        server.stop()
        redis_svc.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_request_on_a_pooled_connection_is_answered_after_the_scheduler_stalled(scheduler) -> None:
    """The client's connection is idle 1 s (well within its pool's expiry) when it sends its next
    request, but the scheduler is stopped (SIGSTOP, as a loaded machine would leave it unscheduled)
    from its first answer until past uvicorn's default keep-alive of 5 s."""
    url, server = scheduler
    with httpx.Client(base_url=url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
        assert http.get("/v1/health").status_code == 200
        server.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            time.sleep(1)
            second = pool.submit(http.get, "/v1/health")  # on the pooled connection, idle for 1 s
            time.sleep(max(0.0, stopped + 6 - time.monotonic()))  # no clock to pass: uvicorn's loop reads its own
        finally:
            server.signal(signal.SIGCONT)
        assert second.result(timeout=60).status_code == 200
