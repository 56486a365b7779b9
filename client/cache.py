"""A content-addressed file cache: files are named by their sha256 and verified before use."""

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class HashMismatch(Exception):
    pass


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class FileCache:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.downloads = 0
        self.hits = 0

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def holds(self) -> list[str]:
        return [p.name for p in self.root.glob("??/*") if p.is_file() and len(p.name) == 64]

    def fetch(self, sha256: str, download: Callable[[Path], None]) -> Path:
        """Return the verified local file for `sha256`, downloading it only if absent.

        Concurrent fetches of one file wait for a single download.
        """
        with self._guard:
            lock = self._locks.setdefault(sha256, threading.Lock())
        with lock:
            path = self.path_for(sha256)
            if path.is_file():
                self.hits += 1
                return path
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{sha256}.{os.getpid()}.{threading.get_ident()}.part")
            try:
                download(tmp)
                actual = file_sha256(tmp)
                if actual != sha256:
                    raise HashMismatch(f"downloaded file has sha256 {actual}, expected {sha256}")
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            self.downloads += 1
            return path
