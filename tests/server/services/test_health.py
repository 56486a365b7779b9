"""Health records of the long-running processes and the deployment's health report, on a real
SQLite file, local storage and a private Redis; the route on the app, the command on a child process."""

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from crowdtrain.core import keys
from crowdtrain.migrations import at_head, upgrade, wait_for_schema
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.services import health
from crowdtrain.server.services.health import KINDS, Heartbeat, beat, forget, report
from tests.server.inprocess import scheduler_app


def _parts(tmp_path: Path, r: redis.Redis, now: float) -> dict:
    from crowdtrain.core.storage import open_storage

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    return report(session_factory(url), r, open_storage((tmp_path / "storage").as_uri(), None), now).parts


def test_each_kind_of_process_is_up_while_one_has_a_live_record_and_missing_without(tmp_path, private_redis) -> None:
    now = 1_000_000.0
    for kind in KINDS:
        beat(private_redis, kind, "a", now - 4.0)
    beat(private_redis, "parameter-server", "b", now - 1.5)
    parts = _parts(tmp_path, private_redis, now)
    assert all(parts[name].ok for name in ("database", "redis", "storage", *KINDS)), parts
    assert parts["parameter-server"].processes == 2 and parts["parameter-server"].newest_age_seconds == 1.5
    assert 0 < private_redis.pttl(keys.health("transitioner", "a")) <= health.TTL_SECONDS * 1000, "records expire"

    forget(private_redis, "transitioner", "a")  # as a record that expired: its process died or hung
    parts = _parts(tmp_path, private_redis, now)
    assert not parts["transitioner"].ok and "no transitioner" in parts["transitioner"].detail
    assert parts["scheduler"].ok


def test_a_database_that_cannot_be_opened_is_reported_down(tmp_path, private_redis) -> None:
    from crowdtrain.core.storage import open_storage

    db = session_factory(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'db.sqlite'}")
    found = report(db, private_redis, open_storage((tmp_path / "s").as_uri(), None), time.time())
    assert found.status == "degraded" and not found.parts["database"].ok and found.parts["database"].detail


def test_a_heartbeat_writes_its_record_at_once_and_deletes_it_when_stopped(private_redis) -> None:
    heartbeat = Heartbeat(private_redis, "transitioner", "t1", clock=lambda: 42.0).start()
    assert private_redis.get(keys.health("transitioner", "t1")) is not None
    heartbeat.stop()
    assert private_redis.get(keys.health("transitioner", "t1")) is None


def test_the_route_answers_503_until_every_kind_of_process_reports(tmp_path, private_redis) -> None:
    with scheduler_app(tmp_path, private_redis) as sched:
        assert sched.http.get("/v1/health/live").json() == {"status": "ok"}
        resp = sched.http.get("/v1/health")
        assert resp.status_code == 503 and resp.json()["status"] == "degraded"
        parts = resp.json()["parts"]
        assert parts["scheduler"]["ok"] and parts["database"]["ok"] and parts["storage"]["ok"]
        assert not parts["parameter-server"]["ok"] and not parts["transitioner"]["ok"]
        for kind in ("parameter-server", "transitioner"):
            beat(private_redis, kind, "x", time.time())
        resp = sched.http.get("/v1/health")
        assert resp.status_code == 200 and resp.json()["status"] == "ok", resp.json()
    assert not private_redis.keys(keys.health_pattern("scheduler")), "a scheduler that stopped is not missing"


def test_the_transitioner_waits_for_the_schema(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    stop = threading.Event()
    stop.set()
    assert not at_head(url) and wait_for_schema(url, stop) is False, "stopped while waiting"
    upgrade(url)
    assert at_head(url) and wait_for_schema(url, threading.Event()) is True


def test_the_health_command_prints_each_part_and_exits_1_while_one_is_down(scheduler) -> None:
    """Only the scheduler runs (a real `crowdtrain server` process): no parameter server, no transitioner."""
    url, _ = scheduler
    done = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "health", "--server", url],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 1, done.stderr
    assert "transitioner" in done.stdout and "NO" in done.stdout and "status: degraded" in done.stdout
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("│")}
    assert "yes" in lines["scheduler"] and "yes" in lines["database"] and "NO" in lines["parameter-server"]


def _local_check(r: redis.Redis, kind: str) -> subprocess.CompletedProcess:
    """`crowdtrain health --local-process KIND` in a child process, on the private Redis."""
    port = r.connection_pool.connection_kwargs["port"]
    return subprocess.run(
        [sys.executable, "-m", "crowdtrain", "health", "--local-process", kind],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "CROWDTRAIN_REDIS_URL": f"redis://127.0.0.1:{port}/0"},
    )


def test_the_local_process_check_passes_on_a_fresh_record_of_this_host_only(private_redis) -> None:
    """What the compose health checks of the parameter servers and the transitioner run."""
    missing = _local_check(private_redis, "transitioner")
    assert missing.returncode == 1 and "no transitioner on" in missing.stderr, missing

    # Another host's fresh record says nothing about this one (each container is its own host).
    record = {"pid": 1, "host": "another-host", "at": time.time()}
    private_redis.set(keys.health("transitioner", "other"), json.dumps(record), px=60_000)
    assert _local_check(private_redis, "transitioner").returncode == 1

    beat(private_redis, "transitioner", "here", time.time())
    fresh = _local_check(private_redis, "transitioner")
    assert fresh.returncode == 0 and f"transitioner on {socket.gethostname()}: reported" in fresh.stdout, fresh

    # A record still in Redis but not renewed within its time-to-live: the process hangs.
    beat(private_redis, "parameter-server", "here", time.time() - 2 * health.TTL_SECONDS, ttl=600)
    stale = _local_check(private_redis, "parameter-server")
    assert stale.returncode == 1 and "last reported" in stale.stderr, stale


def test_the_local_process_check_refuses_an_unknown_kind_and_says_so_when_redis_is_down(private_redis) -> None:
    unknown = _local_check(private_redis, "assimilator")
    assert unknown.returncode == 2 and "parameter-server" in unknown.stderr and "Traceback" not in unknown.stderr
    private_redis.shutdown(nosave=True)
    down = _local_check(private_redis, "transitioner")
    assert down.returncode == 1 and "Redis cannot be reached" in down.stderr and "Traceback" not in down.stderr
