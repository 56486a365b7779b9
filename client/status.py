"""What the running client is doing, for `crowdtrain client status`.

The client rewrites `status.json` in its cache directory (write, then atomic rename) every couple
of seconds and on every change; the status command reads it. A file whose pid is gone, or that
has not been rewritten for STALE_SECONDS, belongs to a client that is not running.
"""

import json
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

import psutil
from pydantic import BaseModel

from crowdtrain.client.files import replace_file

log = logging.getLogger(__name__)

FILE_NAME = "status.json"
WRITE_EVERY = 2.0
STALE_SECONDS = 15.0


class ClientState(StrEnum):
    working = "working"
    waiting = "waiting for work"
    not_idle = "paused: machine not idle"
    over_cap = "over daily cap"
    stopping = "stopping"


class AssignmentStatus(BaseModel):
    assignment_id: int
    job_id: int
    epoch: int
    shard_index: int
    phase: str  # downloading | training | uploading (paused while the machine is in use)
    started_at: datetime
    deadline: datetime


class ClientStatus(BaseModel):
    pid: int
    state: ClientState
    reason: str = ""
    server: str
    updated_at: datetime
    assignments: list[AssignmentStatus]
    cache_bytes: int
    cache_max_bytes: int | None
    transfer_day: str
    downloaded_bytes: int
    uploaded_bytes: int
    daily_download_bytes: int | None
    daily_upload_bytes: int | None
    preferences: dict


def status_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / FILE_NAME


def read_status(cache_dir: Path) -> ClientStatus | None:
    try:
        return ClientStatus.model_validate_json(status_path(cache_dir).read_text())
    except (OSError, ValueError):
        return None


def is_running(status: ClientStatus | None, now: datetime) -> bool:
    """The writer is alive and the file is fresh (a crashed client leaves a stale file behind)."""
    if status is None:
        return False
    fresh = (now - status.updated_at).total_seconds() < STALE_SECONDS
    return fresh and psutil.pid_exists(status.pid)


class StatusWriter:
    """Rewrites the status file every WRITE_EVERY seconds and soon after `changed()`."""

    def __init__(self, cache_dir: Path, snapshot: Callable[[], ClientStatus]):
        self.path = status_path(cache_dir)
        self.snapshot = snapshot
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="status", daemon=True)

    def start(self) -> None:
        self.write()
        self.thread.start()

    def changed(self) -> None:
        self.wake.set()

    def close(self) -> None:
        """Stop rewriting; the caller writes the final state itself."""
        self.stop.set()
        self.wake.set()
        self.thread.join(timeout=5)

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.wake.wait(WRITE_EVERY)
            self.wake.clear()
            if not self.stop.is_set():
                self.write()

    def write(self) -> None:
        try:
            status = self.snapshot()
            replace_file(self.path, status.model_dump_json(indent=1))
        except Exception:  # the status file must never take the client down
            log.exception("could not write %s", self.path)


def now_utc() -> datetime:
    return datetime.now(UTC)


def render(status: ClientStatus):
    """A rich renderable: the state, the running assignments, cache and transfer figures."""
    from rich.console import Group
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row("state", f"[bold]{status.state.value}[/bold]" + (f" ({status.reason})" if status.reason else ""))
    head.add_row("pid", str(status.pid))
    head.add_row("server", status.server)
    head.add_row("updated", status.updated_at.isoformat(timespec="seconds"))
    head.add_row("cache", _of(status.cache_bytes, status.cache_max_bytes))
    head.add_row(
        f"today ({status.transfer_day} UTC)",
        f"downloaded {_of(status.downloaded_bytes, status.daily_download_bytes)}, "
        f"uploaded {_of(status.uploaded_bytes, status.daily_upload_bytes)}",
    )
    head.add_row("preferences", json.dumps(status.preferences))
    work = Table("assignment", "job", "epoch", "shard", "phase", "started", "deadline", title="running assignments")
    for a in status.assignments:
        work.add_row(
            str(a.assignment_id),
            str(a.job_id),
            str(a.epoch),
            str(a.shard_index),
            a.phase,
            a.started_at.isoformat(timespec="seconds"),
            a.deadline.isoformat(timespec="seconds"),
        )
    return Group(head, work)


def _of(used: int, limit: int | None) -> str:
    return f"{_size(used)} of {_size(limit)}" if limit is not None else f"{_size(used)} (no limit)"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
