"""One running client per cache directory.

Two clients sharing a cache would read one host token and so be one host to the scheduler, and would
evict and journal each other's files. A running client holds an exclusive lock on `client.lock` in its
cache (flock: the kernel drops it when the process ends, however it ends), with its pid written inside
for the message a second client prints when it refuses to start.
"""

import fcntl
import os
import time
from pathlib import Path

LOCK_FILE = "client.lock"


class CacheInUse(RuntimeError):
    """Another running client holds the cache."""


class CacheLock:
    def __init__(self, cache_dir: Path):
        self.path = cache_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, wait_seconds: float = 10.0) -> None:
        """Hold the cache, waiting up to `wait_seconds` for a client that is exiting (a restart right
        after a stop); CacheInUse naming the holder if it is still held then."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise CacheInUse(
                        f"another client (pid {holder}) is using the cache {self.path.parent}: "
                        "give each client on a machine its own --cache"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
