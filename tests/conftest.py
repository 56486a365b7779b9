"""Fixtures that start real services: PostgreSQL databases, private Redis servers, whole clusters."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text

from crowdtrain.launch.cluster import Cluster, free_port, fresh_postgres_database, start_redis
from crowdtrain.server.ledger.db import normalize_url, session_factory

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = ROOT / "examples" / "mnist1d-cnn.yaml"
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _admin_pg_url() -> str:
    return normalize_url(os.environ.get("CROWDTRAIN_TEST_DATABASE_URL", DEFAULT_PG))


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards.

    When PostgreSQL cannot be reached the test is skipped, except under CI=true where it fails.
    """
    base = _admin_pg_url()
    try:
        admin = create_engine(base, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text("select 1"))
        admin.dispose()
    except Exception as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at {base} is unreachable under CI=true: {exc}")
        pytest.skip(f"PostgreSQL at {base} is unreachable: {exc}")
    with fresh_postgres_database(base) as url:
        yield url
        session_factory(url).kw["bind"].dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'crowdtrain.db'}"


@pytest.fixture
def database_url(request, tmp_path: Path) -> str:
    """Parametrize with indirect=True: 'sqlite' or 'postgresql'."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[redis.Redis]:
    port = free_port()
    svc = start_redis(tmp_path / "redis", port)
    client = redis.Redis(port=port)
    try:
        yield client
    finally:
        client.close()
        svc.stop()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator:
    """Factory for a Cluster of real processes in a temp dir; every cluster is stopped at the end."""
    started: list[Cluster] = []

    def make(database_url: str = "", **kwargs) -> Cluster:
        cluster = Cluster(var_dir=tmp_path / f"cluster{len(started)}", database_url=database_url, **kwargs)
        started.append(cluster)
        return cluster.start()

    yield make
    for c in started:
        c.stop()
