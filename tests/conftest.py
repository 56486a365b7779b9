"""Fixtures that start real services: PostgreSQL databases, private Redis servers, whole clusters."""

import os
import shutil
import subprocess
import sys
import zipfile
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
# What is not the sources: environments, build outputs, run-time state, caches.
NOT_SOURCES = {".venv", "build", "dist", "var", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def _admin_pg_url() -> str:
    return normalize_url(os.environ.get("CROWDTRAIN_TEST_DATABASE_URL", DEFAULT_PG))


def _not_sources(folder: str, names: list[str]) -> set[str]:
    top = Path(folder) == ROOT
    return {n for n in names if n == "__pycache__" or top and (n in NOT_SOURCES or n.endswith(".egg-info"))}


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the repository's sources, built from a copy of them: a build in the repository
    itself keeps modules that no longer exist in its build/lib and packs them into the wheel."""
    src = tmp_path_factory.mktemp("sources") / "crowdtrain"
    shutil.copytree(ROOT, src, ignore=_not_sources, symlinks=True)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
    (built,) = out.glob("crowdtrain-*.whl")
    return built


@pytest.fixture(scope="session")
def installed_tree(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed layout, every module under `crowdtrain.` (the wheel unpacked), for tools that
    resolve modules by path: the repository's folders do not map to module names."""
    tree = tmp_path_factory.mktemp("installed")
    with zipfile.ZipFile(built_wheel) as zf:
        zf.extractall(tree)
    return tree


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
