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
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_a_request_on_a_pooled_connection_is_answered_after_the_scheduler_stalled(scheduler) -> None:
    """The client's connection is idle 1 s (well within its pool's expiry) when it sends its next
    request, but the scheduler is stopped (SIGSTOP, as a loaded machine would leave it unscheduled)
    from its first answer until past uvicorn's default keep-alive of 5 s."""
    url, server = scheduler
    with httpx.Client(base_url=url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
        assert http.get("/v1/health/live").status_code == 200
        server.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            time.sleep(1)
            second = pool.submit(http.get, "/v1/health/live")  # on the pooled connection, idle for 1 s
            time.sleep(max(0.0, stopped + 6 - time.monotonic()))  # no clock to pass: uvicorn's loop reads its own
        finally:
            server.signal(signal.SIGCONT)
        assert second.result(timeout=60).status_code == 200
