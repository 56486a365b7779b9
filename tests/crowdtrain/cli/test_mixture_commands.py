"""`crowdtrain mixture create|status` against a real scheduler process: a mixture made from a layout
file, its experts' hosts and leases shown; a bad layout or an unknown mixture said plainly."""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
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
from tests.stub_http import healthy, stub_server

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """The scheduler process alone (and its Redis), on SQLite; its tokens in the returned Cluster."""
    redis_port = free_port()
    redis_svc = start_redis(tmp_path / "redis", redis_port)
    cluster = Cluster(var_dir=tmp_path / "var", redis_url=f"redis://127.0.0.1:{redis_port}/0", port=free_port())
    server = Service("server", crowdtrain_argv("server", "--port", str(cluster.port)), cluster.env, tmp_path / "s.log")
    server.start()
    try:
        wait_for(lambda: scheduler_is_live(cluster.url), 120, "the scheduler did not come up", server)
        yield cluster
    finally:
        server.stop()
        redis_svc.stop()


def crowdtrain(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CROWDTRAIN_ADMIN_TOKEN": cluster.admin_token, "COLUMNS": "160"}
    argv = [sys.executable, "-m", "crowdtrain", "mixture", *args]
    return subprocess.run([*argv, "--server", cluster.url], env=env, capture_output=True, text=True, timeout=120)


def test_the_operator_creates_a_mixture_and_sees_where_its_experts_are(cluster: Cluster, tmp_path: Path) -> None:
    layout = tmp_path / "layout.yaml"
    layout.write_text("layers: 1\ngrid: [2, 3]\ndim: 8\nhidden: 16\nk: 2\n")
    created = crowdtrain(cluster, "create", str(layout), "--name", "wide")
    assert created.returncode == 0, created.stderr
    mixture = int(created.stdout.strip())

    with stub_server(healthy) as host_url:
        token = httpx.post(f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": "h"}).json()
        leased = httpx.post(
            f"{cluster.url}/v1/mixtures/{mixture}/leases",
            json={"url": host_url, "capacity": 2},
            headers={"Authorization": f"Bearer {token['host_token']}"},
        )
        assert leased.status_code == 200, leased.text

    shown = crowdtrain(cluster, "status", str(mixture))
    assert shown.returncode == 0, shown.stderr
    assert f"mixture {mixture} 'wide' (open): 1 layers of 2x3 experts, 2 of 6 served" in shown.stdout
    rows = [line for line in shown.stdout.splitlines() if line.startswith("│ 0.")]
    assert len(rows) == 6 and sum(host_url in row for row in rows) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [("grid: [300]\n", "grid sizes"), ("k: [1\n", "not valid YAML"), ("unknown: 1\n", "unknown")],
)
def test_a_layout_that_cannot_work_is_refused_before_anything_is_sent(cluster, tmp_path, content, message) -> None:
    layout = tmp_path / "bad.yaml"
    layout.write_text(content)
    done = crowdtrain(cluster, "create", str(layout))
    assert done.returncode == 2 and message in done.stderr and "bad.yaml" in done.stderr, done.stderr
    with httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {cluster.admin_token}"}) as admin:
        assert admin.get("/v1/mixtures/1").status_code == 404


def test_an_unknown_mixture_is_said_to_be_unknown(cluster: Cluster) -> None:
    done = crowdtrain(cluster, "status", "42")
    assert done.returncode == 2 and "error 404: mixture 42 does not exist" in done.stderr
