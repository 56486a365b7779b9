import hashlib
import threading
from pathlib import Path

import pytest

from client.cache import FileCache, HashMismatch


def test_a_cached_file_is_downloaded_once_even_by_concurrent_slots(tmp_path: Path) -> None:
    data = b"shard bytes" * 1000
    digest = hashlib.sha256(data).hexdigest()
    cache = FileCache(tmp_path)
    calls = []

    def download(dest: Path) -> None:
        calls.append(dest)
        dest.write_bytes(data)

    paths = []
    threads = [threading.Thread(target=lambda: paths.append(cache.fetch(digest, download))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert {p.read_bytes() for p in paths} == {data}
    assert FileCache(tmp_path).holds() == [digest]


def test_a_corrupt_download_is_refused_and_not_kept(tmp_path: Path) -> None:
    cache = FileCache(tmp_path)
    digest = hashlib.sha256(b"good").hexdigest()
    with pytest.raises(HashMismatch):
        cache.fetch(digest, lambda dest: dest.write_bytes(b"evil"))
    assert cache.holds() == []
    assert list(tmp_path.rglob("*.part")) == []
    assert cache.fetch(digest, lambda dest: dest.write_bytes(b"good")).read_bytes() == b"good"
