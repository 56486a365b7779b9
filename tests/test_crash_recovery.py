"""Kill -9 a component again and again during a run and restart it: the job still completes, and
every workunit and merge is accounted for exactly."""

import os
import random
import re
import signal
import threading
import time

import pytest
import redis
from sqlalchemy import func, select

from crowdtrain.core import keys
from crowdtrain.launch.cluster import scheduler_is_live, wait_for
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Workunit
from tests.test_training_end_to_end import assert_exact_accounting, settle, submit, wait_finished

pytestmark = pytest.mark.integration
KILL_EVERY_S = 5.0  # a restarted component serves at least this long, and through one more merge
KILLS = 3  # at most; the test needs 2
READY_TIMEOUT_S = 240.0  # a restart on 2 busy cores: Redis 1 s; torch makes the others 15-35 s


class Crashes:
    """Kill -9 one component and bring it back, each kill only once its last restart is ready.

    A component killed again before it has finished importing (15-35 s on 2 busy cores for the
    parameter server, the transitioner and the scheduler: torch) never serves, and the run tests
    nothing. So the kills follow the restarts and the job's progress, not the clock: the first comes
    at the job's start, before the clients (`crash`); each next one once the restarted component is
    ready, has served KILL_EVERY_S and the job has merged a result meanwhile (`keep_crashing`). The
    second kill thus comes at the job's first merges, while it still runs, however fast the machine
    (a kill every 5 s, with the clients started at once, let the job end before a second one). The
    timings, in seconds since this began, are kept to explain a failure."""

    def __init__(self, cluster, name: str, job_id: int) -> None:
        self.cluster, self.name, self.job_id = cluster, name, job_id
        self.t0 = time.monotonic()
        self.kills: list[float] = []
        self.ready: list[float] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.r = redis.Redis.from_url(cluster.redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.service = cluster.service("server" if name == "scheduler-worker" else name)
        self.log_offset = 0  # where the log's lines about the current process begin

    def crash(self) -> None:
        """Wait until the component is ready, kill it, start it again and wait until it is ready."""
        if not self.ready:
            self._wait_ready()
        self._kill()
        self.kills.append(self.now())
        self._wait_ready()

    def keep_crashing(self) -> None:
        """Up to KILLS kills in all, each once the job has merged a result since the last restart; for
        a thread: an exception is kept in `error`, for the test to raise, not lost with the thread."""
        try:
            while len(self.kills) < KILLS:
                merged = self._merged()
                if self.stop.wait(KILL_EVERY_S) or not self._wait(lambda m=merged: self._merged() > m):
                    return
                self.crash()
        except BaseException as exc:
            self.error = exc

    def summary(self) -> str:
        return f"kills at {self.kills} s, ready at {self.ready} s"

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def _wait(self, check, timeout: float | None = None) -> bool:
        """Poll `check` until it holds (True) or the run is stopping (False); TimeoutError after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not check():
            if self.stop.wait(0.5):
                return False
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} was not ready within {timeout:.0f} s; {self.summary()}\n{self.service.tail()}"
                )
        return True

    def _merged(self) -> int:
        """W_s's version: how many results the job has merged (-1 while Redis is down)."""
        try:
            return int(self.r.get(keys.version(self.job_id)) or 0)
        except redis.RedisError:
            return -1

    def _kill(self) -> None:
        if self.name == "scheduler-worker":
            # One of the workers; uvicorn's supervisor (the service's process) starts a new one.
            os.kill(random.choice(self.cluster.scheduler_workers()), signal.SIGKILL)
            return
        self.log_offset = self.service.log_path.stat().st_size
        self.service.signal(signal.SIGKILL)
        self.service.proc.wait(60)
        self.service.start()

    def _wait_ready(self) -> None:
        if self._wait(self._is_ready, READY_TIMEOUT_S):
            self.ready.append(self.now())

    def _is_ready(self) -> bool:
        if self.name == "redis":
            try:
                return bool(self.r.ping())
            except redis.RedisError:  # refused, or still loading its append-only file
                return False
        if self.name == "server":
            return scheduler_is_live(self.cluster.url)
        log = self._log()
        if self.name == "transitioner":
            return "transitioner running every" in log
        if self.name == "assimilator":  # Celery's worker has imported the merge task and consumes
            return re.search(r"celery\.apps\.worker: \S+ ready\.", log) is not None
        workers = self.cluster.scheduler_workers()
        return len(workers) == self.cluster.server_workers and all(
            f"scheduler process {pid} serving" in log for pid in workers
        )

    def _log(self) -> str:
        with self.service.log_path.open("rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")


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
    crashes = Crashes(cluster, component, job_id)
    crashes.crash()  # at the job's start; the next ones follow its progress
    cluster.start_client("alice", tasks=2)
    cluster.start_client("bob", tasks=2)
    killer = threading.Thread(target=crashes.keep_crashing, daemon=True)
    killer.start()
    status = "unknown"
    try:
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline and crashes.error is None:
            with cluster.admin() as http:
                try:
                    status = http.get(f"/v1/jobs/{job_id}").json()["status"]
                except Exception:  # the scheduler may be down right now
                    status = "unknown"
            if status in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(1)
        ended = crashes.now()
    finally:
        crashes.stop.set()
        killer.join(READY_TIMEOUT_S + 60)
    print(f"{component}: the job ended ({status}) at {ended} s; {crashes.summary()}")
    if crashes.error is not None:
        raise crashes.error
    assert len(crashes.kills) >= 2, (
        f"{component} was killed only {len(crashes.kills)} times before the job "
        f"ended ({status}) at {ended} s; {crashes.summary()}"
    )
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
