"""Daily transfer caps: real bytes counted per UTC day, kept across restarts, reset when the day rolls over."""

import hashlib
from datetime import date
from pathlib import Path

import pytest

from crowdtrain.client.cache import FileCache
from crowdtrain.client.quota import DailyTransfer, OverDailyCap, counted
from crowdtrain.client.status import ClientState, read_status
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.launch.cluster import wait_for
from tests.client.test_worker import host_assignments, submit_slow_job

DAY1, DAY2 = date(2026, 11, 22), date(2026, 11, 23)


class Clock:
    def __init__(self, day: date):
        self.day = day

    def __call__(self) -> date:
        return self.day


def transfer(tmp_path: Path, clock: Clock, down: int | None = 1000, up: int | None = 1000) -> DailyTransfer:
    return DailyTransfer(tmp_path / "transfer.json", down, up, clock)


def download_into(cache: FileCache, t: DailyTransfer, data: bytes) -> Path:
    """Reserve, download real bytes through the cache, settle: what the client does per file."""
    reservation = t.reserve(len(data), 0)
    try:
        return cache.fetch(
            hashlib.sha256(data).hexdigest(), counted(lambda p: p.write_bytes(data), t, reservation), len(data)
        )
    finally:
        t.release(reservation)


def test_downloaded_bytes_are_counted_and_survive_a_restart(tmp_path: Path) -> None:
    clock = Clock(DAY1)
    cache = FileCache(tmp_path / "shards")
    download_into(cache, transfer(tmp_path, clock), b"x" * 600)
    again = transfer(tmp_path, clock)
    assert again.figures()["used"] == {"download": 600, "upload": 0}
    with pytest.raises(OverDailyCap, match="download cap"):
        download_into(cache, again, b"y" * 600)
    assert len(cache.holds()) == 1, "a download that would pass the cap is not started"
    assert again.figures()["used"]["download"] == 600


def test_a_refused_reservation_stops_work_until_the_day_rolls_over(tmp_path: Path) -> None:
    clock = Clock(DAY1)
    t = transfer(tmp_path, clock)
    assert t.over_cap() is None
    with pytest.raises(OverDailyCap):
        t.reserve(0, 1500)
    assert "over daily upload cap" in transfer(tmp_path, clock).over_cap(), "the stop is kept across a restart"
    clock.day = DAY2
    assert t.over_cap() is None
    assert t.figures() == {
        "day": DAY2.isoformat(),
        "used": {"download": 0, "upload": 0},
        "caps": {"download": 1000, "upload": 1000},
    }


def test_reaching_a_cap_stops_work(tmp_path: Path) -> None:
    t = transfer(tmp_path, Clock(DAY1))
    t.record("upload", 1000)
    assert "over daily upload cap (1000 of 1000 bytes" in t.over_cap()


def test_concurrent_assignments_cannot_together_reserve_past_the_cap(tmp_path: Path) -> None:
    t = transfer(tmp_path, Clock(DAY1))
    first = t.reserve(700, 0)
    with pytest.raises(OverDailyCap):
        t.reserve(400, 0)
    t.release(first)
    t.reserve(400, 0)


def test_bytes_moved_settle_the_reservation_so_nothing_is_counted_twice(tmp_path: Path) -> None:
    t = transfer(tmp_path, Clock(DAY1))
    r = t.reserve(500, 0)
    t.record("download", 500, r)
    t.release(r)
    t.reserve(500, 0)  # 500 used + 500 new = the cap exactly


def test_without_caps_nothing_is_refused(tmp_path: Path) -> None:
    t = transfer(tmp_path, Clock(DAY1), down=None, up=None)
    t.record("download", 10**12)
    t.reserve(10**12, 10**12)
    assert t.over_cap() is None


@pytest.mark.integration
def test_a_client_over_its_daily_cap_hands_work_back_and_asks_for_none_even_after_a_restart(
    make_cluster, sqlite_url: str
) -> None:
    cluster = make_cluster(sqlite_url)
    submit_slow_job(cluster)
    cache = cluster.var_dir / "clients" / "frugal"
    # A shard and a snapshot of the example job are ~200 kB: no assignment fits in 100 kB.
    client = cluster.start_client("frugal", 1, "--no-prefetch", "--daily-download-bytes", "100kB")

    def over_cap() -> bool:
        st = read_status(cache)
        return bool(st and st.state == ClientState.over_cap and "download cap" in st.reason)

    wait_for(over_cap, 60, "the client never stopped at its cap", client)

    # The assignment's thread hands it back after the reservation that set the state failed: its
    # request may still be on its way when the status says so.
    def handed_back() -> bool:
        return [st for _, st, _ in host_assignments(sqlite_url, "frugal")] != [AssignmentStatus.in_progress.value]

    wait_for(handed_back, 60, "the assignment was never handed back", client)
    taken = host_assignments(sqlite_url, "frugal")
    assert [st for _, st, _ in taken] == [AssignmentStatus.abandoned.value], "handed back, not failed"
    assert read_status(cache).downloaded_bytes == 0 and not list((cache / "shards").rglob("*")), (
        "a download that would pass the cap is not started"
    )
    assert "over daily cap: over daily download cap" in client.tail()

    client.stop()
    again = cluster.start_client("frugal", 1, "--no-prefetch", "--daily-download-bytes", "100kB")
    wait_for(lambda: over_cap() and read_status(cache).pid == again.proc.pid, 60, "no status after restart", again)
    assert host_assignments(sqlite_url, "frugal") == taken, "the restarted client asked for work over its cap"
