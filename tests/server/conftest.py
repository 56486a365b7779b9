"""Fixtures of the scheduler's tests."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from crowdtrain.launch.cluster import (
    Cluster,
    Service,
    crowdtrain_argv,
    free_port,
    scheduler_is_live,
    start_redis,
    wait_for,
)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[str, Service]]:
    """Only the scheduler process (and the private Redis it is configured with), on SQLite."""
    redis_port = free_port()
    redis_svc = start_redis(tmp_path / "redis", redis_port)
    cluster = Cluster(var_dir=tmp_path / "var", redis_url=f"redis://127.0.0.1:{redis_port}/0", port=free_port())
    argv = crowdtrain_argv("server", "--port", str(cluster.port))
    server = Service("server", argv, cluster.env, tmp_path / "server.log").start()
    try:
        wait_for(lambda: scheduler_is_live(cluster.url), 120, "the scheduler did not come up", server)
        yield cluster.url, server
    finally:
        server.stop()
        redis_svc.stop()
