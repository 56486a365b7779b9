"""Daily transfer caps: bytes downloaded and uploaded per UTC day, kept in the cache directory.

An assignment reserves what it will move before it downloads anything (the shard and snapshot it
lacks; an upload the size of the snapshot), so a download that would pass a cap is never started.
Once a reservation is refused, or a cap is reached, the client asks for no work until the UTC day
rolls over. The counts are written to disk on every change, so a restart does not reset them.
"""

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path

from crowdtrain.client.files import replace_file

DIRECTIONS = ("download", "upload")


class OverDailyCap(Exception):
    """Moving these bytes today would pass the volunteer's daily cap."""


@dataclass
class Reservation:
    """Bytes an assignment still expects to move; what it moves is counted against this first."""

    download: int = 0
    upload: int = 0


def _today() -> date:
    return datetime.now(UTC).date()


class DailyTransfer:
    def __init__(
        self, path: Path, download_cap: int | None, upload_cap: int | None, today: Callable[[], date] = _today
    ):
        self.path = Path(path)
        self.caps = {"download": download_cap, "upload": upload_cap}
        self.today = today
        self.lock = threading.Lock()
        self.day, self.used, self.refused = self._load()
        self.reserved = {d: 0 for d in DIRECTIONS}

    # -- persistence ----------------------------------------------------------------------------
    def _load(self) -> tuple[date, dict[str, int], str | None]:
        try:
            saved = json.loads(self.path.read_text())
            day = date.fromisoformat(saved["day"])
            used = {d: int(saved[d]) for d in DIRECTIONS}
            refused = saved.get("refused")
            return day, used, refused if refused in DIRECTIONS else None
        except (OSError, ValueError, KeyError, TypeError):
            return self.today(), {d: 0 for d in DIRECTIONS}, None

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, json.dumps({"day": self.day.isoformat(), **self.used, "refused": self.refused}))

    def _roll(self) -> None:
        """A new UTC day starts with nothing used (reservations in flight stay)."""
        today = self.today()
        if today != self.day:
            self.day, self.used, self.refused = today, {d: 0 for d in DIRECTIONS}, None
            self._save()

    # -- the rules ------------------------------------------------------------------------------
    def reserve(self, download: int, upload: int) -> Reservation:
        """Set aside bytes for one assignment, or raise OverDailyCap (and stop taking work today)."""
        want = {"download": download, "upload": upload}
        with self.lock:
            self._roll()
            for d in DIRECTIONS:
                cap = self.caps[d]
                if cap is not None and self.used[d] + self.reserved[d] + want[d] > cap:
                    self.refused = d
                    self._save()
                    raise OverDailyCap(
                        f"{want[d]} bytes to {d} would pass today's {d} cap "
                        f"({self.used[d] + self.reserved[d]} of {cap} used or reserved)"
                    )
            for d in DIRECTIONS:
                self.reserved[d] += want[d]
            return Reservation(download, upload)

    def record(self, direction: str, nbytes: int, reservation: Reservation | None = None) -> None:
        """Count bytes actually moved, releasing as much of `reservation` as they cover."""
        with self.lock:
            self._roll()
            self.used[direction] += nbytes
            if reservation is not None:
                covered = min(nbytes, getattr(reservation, direction))
                setattr(reservation, direction, getattr(reservation, direction) - covered)
                self.reserved[direction] -= covered
            self._save()

    def release(self, reservation: Reservation) -> None:
        """Give back what an ended assignment did not move."""
        with self.lock:
            for d in DIRECTIONS:
                self.reserved[d] -= getattr(reservation, d)
                setattr(reservation, d, 0)

    def over_cap(self) -> str | None:
        """Why no work should be taken today, or None."""
        with self.lock:
            self._roll()
            for d in DIRECTIONS:
                cap = self.caps[d]
                if cap is not None and self.used[d] >= cap:
                    return f"over daily {d} cap ({self.used[d]} of {cap} bytes used today, UTC)"
            if self.refused:
                d = self.refused
                return (
                    f"over daily {d} cap (the next assignment would pass it: "
                    f"{self.used[d]} of {self.caps[d]} bytes used today, UTC)"
                )
            return None

    def figures(self) -> dict:
        with self.lock:
            self._roll()
            return {"day": self.day.isoformat(), "used": dict(self.used), "caps": dict(self.caps)}


def counted(
    download: Callable[[Path], None], transfer: DailyTransfer, reservation: Reservation | None
) -> Callable[[Path], None]:
    """Wrap a download so the bytes it wrote are counted against today's download cap."""

    def run(dest: Path) -> None:
        try:
            download(dest)
        finally:
            if dest.exists():
                transfer.record("download", dest.stat().st_size, reservation)

    return run
