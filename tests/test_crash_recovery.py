"""Kill -9 a component again and again during a run and restart it: the job still completes, and
every workunit and merge is accounted for exactly."""

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select

from crowdtrain.core import keys
from crowdtrain.launch.cluster import wait_for
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Workunit
from tests.test_training_end_to_end import assert_exact_accounting, settle, submit, wait_finished

pytestmark = pytest.mark.integration
KILL_EVERY_S = 5.0


def keep_killing_one_scheduler_worker(cluster, stop: threading.Event, kills: list[float]) -> None:
    """Kill one uvicorn worker process at a time; the server's supervisor starts a new one."""
    server = cluster.service("server")
    while not stop.wait(KILL_EVERY_S):
        found = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
        # The supervisor's children are the workers (and multiprocessing's resource tracker).
        workers = [int(pid) for pid in found if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="ignore")]
        if workers:
            os.kill(random.choice(workers), signal.SIGKILL)
            kills.append(time.time())


def keep_killing(cluster, name: str, stop: threading.Event, kills: list[float]) -> None:
    if name == "scheduler-worker":
        return keep_killing_one_scheduler_worker(cluster, stop, kills)
    service = cluster.service(name)
    while not stop.wait(KILL_EVERY_S):
        service.signal(signal.SIGKILL)
        service.proc.wait(10)
        kills.append(time.time())
        service.start()
        if name == "server":
            # A restarted scheduler takes about 5 s to answer on 2 busy cores: the next kill comes
            # KILL_EVERY_S after it is back, or it would be killed again before ever serving.
            wait_for(cluster._healthy, 60, "the restarted scheduler did not come back", service)


@pytest.mark.parametrize("component", ["assimilator", "transitioner", "server", "scheduler-worker", "redis"])
def test_the_job_survives_repeated_sigkill_of(component: str, make_cluster, sqlite_url: str) -> None:
    # Redis restarts from its append-only file (fsync on every write), as in docker-compose.yml.
    cluster = make_cluster(
        sqlite_url,
        redis_appendonly=True,
        server_workers=3 if component == "scheduler-worker" else 1,
        extra_env={
            # A killed parameter server's unacknowledged merge comes back after this many seconds.
            "CROWDTRAIN_BROKER_VISIBILITY_TIMEOUT": "5",
            "CROWDTRAIN_STUCK_UPLOAD_SECONDS": "10",
        },
    )
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
    assert len(kills) >= 2, f"{component} was killed only {len(kills)} times"
    st = wait_finished(cluster, job_id, timeout=60)
    assert st["status"] == "succeeded", st
    assert_exact_accounting(cluster, job_id)


def test_w_s_is_restored_from_its_snapshot_when_redis_loses_everything(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url, extra_env={"CROWDTRAIN_STUCK_UPLOAD_SECONDS": "5"})
    job_id = submit(cluster)
    cluster.start_client("alice", tasks=2)
    cluster.start_client("bob", tasks=2)
    r = redis.Redis.from_url(cluster.redis_url)
    wait_for(lambda: int(r.get(keys.version(job_id)) or 0) >= 6, 120, "no merges happened")
    r.flushall()  # W_s, the merge ledger and the Celery queue are all gone
    st = wait_finished(cluster, job_id)
    assert st["status"] == "succeeded", st
    assert "restored snapshot" in cluster.service("assimilator").tail(400)
    db = session_factory(sqlite_url)
    settle(cluster, db)
    with db.begin() as s:
        wus = s.scalars(select(Workunit).where(Workunit.job_id == job_id)).all()
        assert {wu.status for wu in wus} <= {"done", "failed", "cancelled"}
        merged = s.execute(
            select(Assignment.workunit_id, func.count())
            .where(Assignment.job_id == job_id, Assignment.status == "merged")
            .group_by(Assignment.workunit_id)
        ).all()
        assert all(n == 1 for _, n in merged), "a workunit was merged twice"
