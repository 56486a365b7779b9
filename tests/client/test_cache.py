import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from crowdtrain.client.cache import BadHash, CacheBudget, CacheFull, FileCache, HashMismatch


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
    with pytest.raises(HashMismatch) as refused:
        cache.fetch(digest, lambda dest: dest.write_bytes(b"evil"))
    # The refusal is reported to the scheduler: it must not tell what the URL's content hashes to.
    assert hashlib.sha256(b"evil").hexdigest() not in str(refused.value)
    assert cache.holds() == []
    assert list(tmp_path.rglob("*.part")) == []
    assert cache.fetch(digest, lambda dest: dest.write_bytes(b"good")).read_bytes() == b"good"


def put(cache: FileCache, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    cache.fetch(digest, lambda dest: dest.write_bytes(data), len(data))
    return digest


def blob(tag: int, size: int = 100) -> bytes:
    return bytes([tag]) * size


def age(cache: FileCache, digest: str, seconds_ago: float) -> None:
    """Recency is the file's mtime; set it explicitly so the order does not hang on clock resolution."""
    t = time.time() - seconds_ago
    os.utime(cache.path_for(digest), (t, t))


def test_the_least_recently_used_file_is_evicted_first_and_a_hit_refreshes_recency(tmp_path: Path) -> None:
    budget = CacheBudget(max_bytes=300)
    cache = FileCache(tmp_path, budget)
    a, b, c = put(cache, blob(1)), put(cache, blob(2)), put(cache, blob(3))
    for digest, ago in ((a, 30), (b, 20), (c, 10)):
        age(cache, digest, ago)
    cache.fetch(a, lambda dest: pytest.fail("a cached file is not downloaded again"))  # a is now the newest
    d = put(cache, blob(4))
    assert set(cache.holds()) == {a, c, d}, "b was the least recently used"
    assert budget.used_bytes() == 300


def test_shards_and_snapshots_share_one_limit(tmp_path: Path) -> None:
    budget = CacheBudget(max_bytes=250)
    shards, snapshots = FileCache(tmp_path / "shards", budget), FileCache(tmp_path / "snapshots", budget)
    old_shard = put(shards, blob(1))
    age(shards, old_shard, 60)
    put(snapshots, blob(2))
    put(snapshots, blob(3))
    assert shards.holds() == [] and len(snapshots.holds()) == 2
    assert budget.used_bytes() <= 250


def test_files_in_use_are_never_evicted_and_a_file_that_cannot_fit_is_refused(tmp_path: Path) -> None:
    pinned: set[str] = set()
    cache = FileCache(tmp_path, CacheBudget(max_bytes=200, in_use=lambda: pinned))
    a, _b = put(cache, blob(1)), put(cache, blob(2))
    age(cache, a, 60)
    pinned.add(a)
    c = put(cache, blob(3))
    assert set(cache.holds()) == {a, c}, "b went although a was older: a is in use"
    pinned.add(c)
    with pytest.raises(CacheFull, match="in use by running assignments"):
        put(cache, blob(4))
    assert set(cache.holds()) == {a, c}
    assert list(tmp_path.rglob("*.part")) == [], "the refused download was never started"


def test_eviction_makes_room_before_the_download_starts(tmp_path: Path) -> None:
    cache = FileCache(tmp_path, CacheBudget(max_bytes=200))
    old = put(cache, blob(1, 150))
    seen_during_download: list[list[str]] = []

    def download(dest: Path) -> None:
        seen_during_download.append(cache.holds())
        dest.write_bytes(blob(2, 150))

    cache.fetch(hashlib.sha256(blob(2, 150)).hexdigest(), download, 150)
    assert seen_during_download == [[]], f"{old} should have been evicted before the download began"


def test_without_a_limit_nothing_is_evicted(tmp_path: Path) -> None:
    cache = FileCache(tmp_path)
    digests = {put(cache, blob(i, 10_000)) for i in range(5)}
    assert set(cache.holds()) == digests


@pytest.mark.parametrize(
    "name",
    ["../victim/file", "/etc/passwd", "../" * 3 + "a" * 55, "A" * 64, "a" * 63, "a" * 65, "g" * 64, "a" * 63 + "\n"],
)
def test_a_name_that_is_not_a_sha256_never_names_a_path(tmp_path: Path, name: str) -> None:
    cache = FileCache(tmp_path / "cache")
    with pytest.raises(BadHash):
        cache.path_for(name)
    with pytest.raises(BadHash):
        cache.fetch(name, lambda dest: dest.write_bytes(b"x"))
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_a_link_inside_the_cache_cannot_lead_out_of_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    digest = hashlib.sha256(b"x").hexdigest()
    (outside / digest).write_bytes(b"x")
    cache = FileCache(tmp_path / "cache")
    (cache.root / digest[:2]).symlink_to(outside)
    with pytest.raises(BadHash):
        cache.fetch(digest, lambda dest: dest.write_bytes(b"x"))
