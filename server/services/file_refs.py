"""Where hosts download the files of their work: presigned URLs on object storage that can presign,
the scheduler's own routes otherwise."""

import threading
import time

from crowdtrain.core.schemas import FileRef
from crowdtrain.core.storage import Storage


class _PresignedUrls:
    """Presigned download URLs, reused while more than half of their life is left."""

    def __init__(self) -> None:
        self._urls: dict[str, tuple[float, str | None]] = {}
        self._lock = threading.Lock()

    def url(self, storage: Storage, key: str, seconds: int) -> str | None:
        now = time.monotonic()
        with self._lock:
            hit = self._urls.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        url = storage.presigned_url(key, seconds)
        with self._lock:
            if len(self._urls) > 100_000:
                self._urls.clear()
            self._urls[key] = (now + seconds / 2, url)
        return url


_presigned = _PresignedUrls()


def presigned_url(storage: Storage, key: str, seconds: int) -> str | None:
    """A presigned download URL of `key` (reused while more than half of its life is left), or None
    when the storage cannot presign."""
    return _presigned.url(storage, key, seconds)


def snapshot_ref(
    storage: Storage, job_id: int, version: int, key: str, sha256: str, size: int, presign_seconds: int
) -> FileRef:
    """Where a host downloads snapshot `version` of the job (stored at `key`): object storage that can
    presign serves the bytes itself; otherwise the scheduler does."""
    url = _presigned.url(storage, key, presign_seconds)
    return FileRef(url=url or f"/v1/jobs/{job_id}/snapshots/{version}", sha256=sha256, size=size)
