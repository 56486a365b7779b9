"""`crowdtrain client status`: the status file a running client keeps, read by the status command."""

import os
import signal
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from crowdtrain.client.status import ClientState, ClientStatus, is_running, now_utc, read_status
from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv, wait_for
from tests.client.test_worker import host_assignments, submit_slow_job


def client_status(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        crowdtrain_argv("client", "status", "--cache", str(cache)),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


def cache_of(cluster: Cluster, name: str) -> Path:
    return cluster.var_dir / "clients" / name


def training_status(cache: Path, count: int):
    """A check for wait_for: the status once `count` assignments are training."""

    def check() -> ClientStatus | None:
        st = read_status(cache)
        if st and st.state == ClientState.working and [a.phase for a in st.assignments].count("training") == count:
            return st
        return None

    return check


def fake_status(pid: int, age: float) -> ClientStatus:
    return ClientStatus(
        pid=pid,
        state=ClientState.waiting,
        server="http://x",
        updated_at=now_utc() - timedelta(seconds=age),
        assignments=[],
        cache_bytes=0,
        cache_max_bytes=None,
        transfer_day="2026-11-22",
        downloaded_bytes=0,
        uploaded_bytes=0,
        daily_download_bytes=None,
        daily_upload_bytes=None,
        preferences={},
    )


def test_a_fresh_file_of_a_live_pid_is_running_and_a_stale_or_orphaned_one_is_not() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert is_running(fake_status(os.getpid(), 1), now_utc())
    assert not is_running(fake_status(os.getpid(), 60), now_utc())
    assert not is_running(fake_status(dead.pid, 1), now_utc())
    assert not is_running(None, now_utc())


@pytest.mark.integration
def test_status_shows_what_a_running_client_does_and_not_running_once_it_exits(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url)
    submit_slow_job(cluster)
    client = cluster.start_client(
        "watched", 2, "--cache-max-bytes", "50MB", "--daily-download-bytes", "1GB", "--idle-minutes", "7"
    )
    cache = cache_of(cluster, "watched")
    wait_for(training_status(cache, 2), 90, "the client never showed two assignments training", client)
    st = read_status(cache)
    assert st.pid == client.proc.pid
    assert {a.assignment_id for a in st.assignments} == {
        aid for aid, status, _ in host_assignments(sqlite_url, "watched") if status == "in_progress"
    }
    assert st.cache_max_bytes == 50_000_000 and 0 < st.cache_bytes <= 50_000_000
    assert st.daily_download_bytes == 10**9 and st.downloaded_bytes >= st.cache_bytes, "every cached byte was counted"
    assert st.preferences["idle_minutes"] == 7

    shown = client_status(cache)
    assert shown.returncode == 0, shown.stderr
    for text in (
        "working",
        str(client.proc.pid),
        "training",
        *(str(a.assignment_id) for a in st.assignments),
        "50.0 MB",
        "1.0 GB",
    ):
        assert text in shown.stdout, f"{text!r} missing from\n{shown.stdout}"

    client.proc.send_signal(signal.SIGTERM)
    assert client.proc.wait(30) == 0, client.tail()
    gone = client_status(cache)
    assert (gone.returncode, gone.stdout.split(" (")[0]) == (1, "not running"), gone.stdout


@pytest.mark.integration
def test_a_killed_client_is_reported_not_running(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url)
    client: Service = cluster.start_client("crashy", 1)
    cache = cache_of(cluster, "crashy")
    wait_for(lambda: client_status(cache).returncode == 0, 60, "the client never wrote its status", client)
    client.signal(signal.SIGKILL)
    client.proc.wait(10)
    shown = client_status(cache)
    assert shown.returncode == 1 and shown.stdout.startswith("not running"), shown.stdout
