"""A content-addressed file cache: files are named by their sha256 and verified before use.

Shards and snapshots are two `FileCache`s that may share one `CacheBudget`: a single size limit
over both, because a volunteer grants disk space, not space per kind of file. When a download
would pass the limit, the least recently used files are deleted first. A file's mtime is its
recency (a hit touches it), so the order survives restarts. Files that running assignments use
(`in_use`) and files being downloaded are never deleted; if they alone fill the limit the
download is refused with CacheFull.

A sha256 comes from the server: anything but 64 lowercase hex digits is refused (BadHash) before
it names a path, so no file outside the cache is ever read, created or deleted.
"""

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


class HashMismatch(Exception):
    pass


class CacheFull(Exception):
    """The file does not fit under the cache limit even after evicting everything not in use."""


class BadHash(ValueError):
    """A string that is not a sha256 (64 lowercase hex digits) was given as a file's name."""


SHA256 = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CacheBudget:
    """One size limit (None: unlimited) over several FileCaches, least recently used evicted first."""

    def __init__(self, max_bytes: int | None, in_use: Callable[[], set[str]] = set):
        self.max_bytes = max_bytes
        self.in_use = in_use
        self.caches: list[FileCache] = []
        self.lock = threading.Lock()
        self.incoming: dict[str, int] = {}  # sha256 -> bytes of downloads in flight
        self.evictions = 0

    def files(self) -> list[tuple[float, int, Path]]:
        """(recency, size, path) of every cached file."""
        found = []
        for cache in self.caches:
            for p in cache.root.glob("??/*"):
                try:
                    st = p.stat()
                except FileNotFoundError:  # evicted or pruned meanwhile
                    continue
                if len(p.name) == 64:
                    found.append((st.st_mtime, st.st_size, p))
        return found

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.files())

    @contextmanager
    def room_for(self, sha256: str, size: int) -> Iterator[None]:
        """Evict until `size` more bytes fit, and hold that room while the download runs."""
        with self.lock:
            if self.max_bytes is not None:
                self._evict(size, self.max_bytes)
            self.incoming[sha256] = size
        try:
            yield
        finally:
            with self.lock:
                self.incoming.pop(sha256, None)

    def _evict(self, size: int, limit: int) -> None:
        files = self.files()
        used = sum(s for _, s, _ in files) + sum(self.incoming.values())
        keep = self.in_use() | set(self.incoming)
        for _, fsize, path in sorted(files):
            if used + size <= limit:
                break
            if path.name in keep:
                continue
            path.unlink(missing_ok=True)
            used -= fsize
            self.evictions += 1
            log.info("cache: evicted %s (%d bytes, least recently used)", path.name[:12], fsize)
        if used + size > limit:
            raise CacheFull(
                f"{size} bytes do not fit in the cache limit of {limit} bytes: "
                f"{used} bytes are in use by running assignments"
            )


def _touch(path: Path) -> bool:
    """Mark a cached file as just used; False if it is not (or no longer) there."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


class FileCache:
    def __init__(self, root: Path, budget: CacheBudget | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._resolved_root = self.root.resolve()
        self.budget = budget or CacheBudget(None)
        self.budget.caches.append(self)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.downloads = 0
        self.hits = 0

    def path_for(self, sha256: str) -> Path:
        """`root/ab/abcd...`; BadHash unless `sha256` is one and the path stays inside the cache."""
        if not isinstance(sha256, str) or not SHA256.fullmatch(sha256):
            raise BadHash(f"{sha256!r:.80} is not a sha256 (64 lowercase hex digits)")
        path = self.root / sha256[:2] / sha256
        if not path.resolve().is_relative_to(self._resolved_root):  # a link inside the cache pointing out
            raise BadHash(f"{path} leads outside the cache {self.root}")
        return path

    def holds(self) -> list[str]:
        return [p.name for p in self.root.glob("??/*") if p.is_file() and len(p.name) == 64]

    def has(self, sha256: str) -> bool:
        return self.path_for(sha256).is_file()

    def fetch(self, sha256: str, download: Callable[[Path], None], size: int = 0) -> Path:
        """Return the verified local file for `sha256`, downloading it only if absent.

        Concurrent fetches of one file wait for a single download. A hit makes the file the most
        recently used; a download first evicts to make room for `size` bytes (see CacheBudget).
        """
        path = self.path_for(sha256)
        with self._guard:
            lock = self._locks.setdefault(sha256, threading.Lock())
        with lock:
            if _touch(path):
                self.hits += 1
                return path
            with self.budget.room_for(sha256, size):
                self._download(sha256, path, download)
            self.downloads += 1
            return path

    def _download(self, sha256: str, path: Path, download: Callable[[Path], None]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{sha256}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            download(tmp)
            actual = file_sha256(tmp)
            if actual != sha256:
                # Never the actual digest: reported to the scheduler, it would make the client an oracle
                # for the hash of whatever a URL reaches.
                raise HashMismatch(f"downloaded file does not match its sha256 {sha256}; discarded")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
