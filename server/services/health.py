"""Health records of the long-running processes, and the health report of the whole deployment.

Each scheduler worker, parameter server and transitioner keeps a record in Redis with a time-to-live
and renews it while it runs (`Heartbeat`), as arq's workers do: a process that dies or hangs lets
its record expire, so a kind of process with no record left is missing. The report (`report`, what
`GET /v1/health` answers) adds the database, Redis and object storage, each checked by a small
request of its own.
"""

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys
from crowdtrain.core.schemas import HealthPart, HealthReport
from crowdtrain.core.storage import Storage

log = logging.getLogger(__name__)

KINDS = ("scheduler", "parameter-server", "transitioner")
TTL_SECONDS = 30.0  # a record not renewed for this long expires: its process is gone or hung
STORAGE_PROBE = "health/probe"  # a key no one writes: asking whether it exists reaches the storage


def beat(r: redis.Redis, kind: str, ident: str, now: float, ttl: float = TTL_SECONDS) -> None:
    """Write or renew the health record of process `ident` of `kind`, as of `now` (epoch seconds)."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "at": now}
    r.set(keys.health(kind, ident), json.dumps(record), px=max(1, int(ttl * 1000)))


def forget(r: redis.Redis, kind: str, ident: str) -> None:
    """Delete a record at a clean exit: the process is not missing, it was stopped."""
    r.delete(keys.health(kind, ident))


class Heartbeat:
    """A daemon thread that renews a process's health record every third of its time-to-live until
    stopped; Redis being down only skips a beat."""

    def __init__(
        self, r: redis.Redis, kind: str, ident: str, ttl: float = TTL_SECONDS, clock: Callable[[], float] = time.time
    ):
        self.r, self.kind, self.ident, self.ttl, self.clock = r, kind, ident, ttl, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{kind}", daemon=True)

    def start(self) -> "Heartbeat":
        """Write the record now (so the process counts from its start), then renew it in the background."""
        self._renew()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):
            forget(self.r, self.kind, self.ident)

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            self._renew()

    def _renew(self) -> None:
        try:
            beat(self.r, self.kind, self.ident, self.clock(), self.ttl)
        except redis.RedisError as exc:
            log.warning("health record of this %s not renewed: %s", self.kind, exc)


def report(db: sessionmaker[Session], r: redis.Redis, storage: Storage, now: float) -> HealthReport:
    """The database, Redis, object storage and each kind of process: ok or not, and why."""
    parts = {
        "database": _check(lambda: _select_one(db)),
        "redis": _check(lambda: r.ping()),
        "storage": _check(lambda: storage.exists(STORAGE_PROBE)),
    }
    for kind in KINDS:
        parts[kind] = _processes(r, kind, now) if parts["redis"].ok else HealthPart(ok=False, detail="Redis is down")
    healthy = all(part.ok for part in parts.values())
    return HealthReport(status="ok" if healthy else "degraded", parts=parts)


def _select_one(db: sessionmaker[Session]) -> None:
    with db() as session:
        session.execute(text("SELECT 1"))


def _check(probe: Callable[[], object]) -> HealthPart:
    try:
        probe()
    except Exception as exc:  # any failure of the probe means the part is down; say which
        return HealthPart(ok=False, detail=f"{type(exc).__name__}: {exc}"[:300])
    return HealthPart(ok=True)


def _records(r: redis.Redis, kind: str) -> list[dict]:
    """The live health records of every process of `kind`; unreadable ones are left out."""
    found = list(r.scan_iter(match=keys.health_pattern(kind), count=100))
    records = []
    for raw in r.mget(found) if found else []:
        if raw is None:  # expired since the scan
            continue
        try:
            record = json.loads(raw)
            records.append({"host": str(record["host"]), "at": float(record["at"])})
        except (ValueError, KeyError, TypeError):
            continue
    return records


def _processes(r: redis.Redis, kind: str, now: float) -> HealthPart:
    ages = [max(0.0, now - record["at"]) for record in _records(r, kind)]
    if not ages:
        return HealthPart(ok=False, detail=f"no {kind} has reported in the last {TTL_SECONDS:g} s", processes=0)
    return HealthPart(ok=True, processes=len(ages), newest_age_seconds=round(min(ages), 3))


def host_report_age(r: redis.Redis, kind: str, host: str, now: float) -> float | None:
    """Seconds since a `kind` process on `host` last renewed its record, the newest if several; None when
    none has a record. A container's health check asks it about its own host name."""
    ages = [max(0.0, now - record["at"]) for record in _records(r, kind) if record["host"] == host]
    return min(ages, default=None)
