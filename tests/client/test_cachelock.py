"""One running client per cache directory: a second one refuses to start, naming the first."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from crowdtrain.client.cachelock import CacheInUse, CacheLock


def test_a_second_holder_is_refused_until_the_first_lets_go(tmp_path: Path) -> None:
    first, second = CacheLock(tmp_path / "cache"), CacheLock(tmp_path / "cache")
    first.acquire(wait_seconds=0)
    with pytest.raises(CacheInUse, match=rf"another client \(pid {os.getpid()}\) .*its own --cache"):
        second.acquire(wait_seconds=0.3)
    first.release()
    second.acquire(wait_seconds=0)
    second.release()


def test_the_lock_goes_with_a_killed_process(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from crowdtrain.client.cachelock import CacheLock\n"
            f"CacheLock(Path({str(tmp_path)!r})).acquire()\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheInUse, match=f"pid {holder.pid}"):
            CacheLock(tmp_path).acquire(wait_seconds=0)
    finally:
        holder.kill()
        holder.wait()
    lock = CacheLock(tmp_path)
    lock.acquire(wait_seconds=5)
    lock.release()
