"""Kill -9 a component again and again during a run and restart it: the job still completes, and
every workunit and merge is accounted for exactly."""

import signal
import threading
import time

import pytest

from tests.test_training_end_to_end import assert_exact_accounting, submit, wait_finished

pytestmark = pytest.mark.integration
KILL_EVERY_S = 5.0


def keep_killing(cluster, name: str, stop: threading.Event, kills: list[float]) -> None:
    service = cluster.service(name)
    while not stop.wait(KILL_EVERY_S):
        service.signal(signal.SIGKILL)
        service.proc.wait(10)
        kills.append(time.time())
        service.start()


@pytest.mark.parametrize("component", ["assimilator", "transitioner", "server"])
def test_the_job_survives_repeated_sigkill_of(component: str, make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url, extra_env={
        # A killed parameter server's unacknowledged merge comes back after this many seconds.
        "CROWDTRAIN_BROKER_VISIBILITY_TIMEOUT": "5",
        "CROWDTRAIN_STUCK_UPLOAD_SECONDS": "10",
    })
    job_id = submit(cluster, deadline_seconds=20)
    cluster.start_client("alice", tasks=2)
    cluster.start_client("bob", tasks=2)
    stop, kills = threading.Event(), []
    killer = threading.Thread(target=keep_killing, args=(cluster, component, stop, kills), daemon=True)
    killer.start()
    try:
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline:
            with cluster.admin() as http:
                try:
                    status = http.get(f"/v1/jobs/{job_id}").json()["status"]
                except Exception:  # the scheduler may be down right now
                    status = "unknown"
            if status in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(1)
    finally:
        stop.set()
        killer.join(30)
    cluster.service(component).proc.poll()
    assert len(kills) >= 2, f"{component} was killed only {len(kills)} times"
    st = wait_finished(cluster, job_id, timeout=60)
    assert st["status"] == "succeeded", st
    assert_exact_accounting(cluster, job_id)
