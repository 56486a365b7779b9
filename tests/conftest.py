"""Fixtures that start real services: PostgreSQL databases, private Redis servers, whole clusters."""

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from filelock import FileLock

# Tests run side by side on 2 cores, and start servers and clients of their own: one compute thread
# per process, and OpenMP threads that sleep when they wait. With its default (a team per core that
# spins at every barrier), one test's few convolutions stalled for 900 s while another suite ran
# beside this one. Set before anything here imports torch; inherited by every process tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from sqlalchemy import create_engine, text

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import Cluster, free_port, fresh_postgres_database, start_redis
from crowdtrain.server.ledger.db import normalize_url, session_factory

# Each test's CPU, with the processes it starts, and the tests that spend the most (tests/cpu_report.py).
pytest_plugins = ["tests.cpu_report"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_SPEC = ROOT / "examples" / "mnist1d-cnn.yaml"
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
# The output of the wheel's build (`pip wheel -v`), kept beside the wheel.
BUILD_LOG = "pip-wheel.log"
# What is not the sources: environments, build outputs, run-time state, caches.
NOT_SOURCES = {".venv", "build", "dist", "var", ".git", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def quick_spec(**changes) -> dict:
    """The example job cut to one quick epoch (a quarter of its channels, one local epoch), as a
    submitted spec: it succeeds once epoch 1's merges are in. For a test that needs a job to run and
    end, not to learn; `changes` replace top-level sections."""
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json", exclude_none=True)
    spec |= {"stop": {"target_accuracy": 0.01, "max_epochs": 1}}
    spec["model"]["options"] = {"channels": 8, "kernel_size": 5, "layers": 2}
    spec["training"] |= {"local_epochs": 1}
    return spec | changes


def _admin_pg_url() -> str:
    return normalize_url(os.environ.get("CROWDTRAIN_TEST_DATABASE_URL", DEFAULT_PG))


def _not_sources(folder: str, names: list[str]) -> set[str]:
    top = Path(folder) == ROOT
    return {n for n in names if n == "__pycache__" or top and (n in NOT_SOURCES or n.endswith(".egg-info"))}


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that every xdist worker of this run sees (the run's base temporary folder's parent;
    the run's own base folder when pytest runs alone)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the repository's sources, built from a copy of them: a build in the repository
    itself keeps modules that no longer exist in its build/lib and packs them into the wheel.
    Built once per run: the first xdist worker to need it builds it, the others wait and reuse it; the
    build's output is in BUILD_LOG beside it."""
    shared = shared_folder(tmp_path_factory) / "wheel"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared) + ".lock"):
        found = list(shared.glob("crowdtrain-*.whl"))
        if found:
            return found[0]
        src = tmp_path_factory.mktemp("sources") / "crowdtrain"
        shutil.copytree(ROOT, src, ignore=_not_sources, symlinks=True)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-v",
                "-w",
                str(shared),
                str(src),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"pip wheel failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
        # -v: the build backend's own output, its warnings included, for the packaging tests.
        (shared / BUILD_LOG).write_text(done.stdout + done.stderr)
        (built,) = shared.glob("crowdtrain-*.whl")
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


@pytest.fixture(autouse=True)
def machine_share(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests run side by side on xdist workers, except those marked `serial`: they judge the machine's
    own load (an idle-only client) and run with no other test running. `make test` runs them in a pass of their
    own after the others; this lock keeps them alone when a run mixes both (`pytest -n 4` by hand).

    A reader-writer lock over the run's workers: every test holds `share` shared, a serial test
    holds it exclusively. The `turnstile` makes a waiting serial test block the tests that would
    start after it, so that it is not starved by workers taking turns on the shared lock."""
    shared = shared_folder(tmp_path_factory)
    serial = request.node.get_closest_marker("serial") is not None
    with open(shared / "turnstile.lock", "w") as turnstile, open(shared / "share.lock", "w") as share:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(share, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(share, fcntl.LOCK_UN)
