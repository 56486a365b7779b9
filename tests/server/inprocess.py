"""The scheduler app inside the test process (FastAPI TestClient): a real SQLite file, file storage and
a real private Redis, without the seconds a Cluster's processes take to start. For API-level checks.

Callers come in two styles: a TestClient per caller (`client`, `admin`, `register`, which can also
name the caller's address), or the shared `http` client with an Authorization header per request
(`admin_headers`, `register_host`).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.settings import Settings
from crowdtrain.launch.cluster import free_port, start_redis
from crowdtrain.migrations import upgrade
from crowdtrain.server.api.app import create_app
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Base

# Of at least 128 bits (crowdtrain.core.settings.MIN_TOKEN_BITS), like any token the scheduler accepts.
ADMIN_TOKEN = "test-admin-Q7mZ2xK9pW4vL8nR3tY6"
JOIN_TOKEN = "test-join-H5cF8jD2sA9gB4kN7qE1"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Scheduler:
    app: FastAPI
    http: TestClient
    db: sessionmaker[Session]
    storage_dir: Path
    settings: Settings

    def client(self, token: str | None = None, address: str = "testclient") -> TestClient:
        """A caller from `address`, with `token` as its bearer token (none if None)."""
        return TestClient(self.app, headers=bearer(token) if token is not None else {}, client=(address, 50000))

    def admin(self, address: str = "testclient") -> TestClient:
        return self.client(self.settings.admin_token, address)

    def register(self, name: str, address: str = "testclient", account: str = "") -> TestClient:
        """A newly registered host, as a client carrying its host token."""
        return self.client(self.register_token(name, address, account), address)

    def register_token(self, name: str = "h1", address: str = "testclient", account: str = "") -> str:
        """A newly registered host's token."""
        resp = self.client(address=address).post(
            "/v1/hosts", json={"join_token": self.settings.join_token, "name": name, "account": account}
        )
        assert resp.status_code == 201, resp.text
        return resp.json()["host_token"]

    @property
    def admin_headers(self) -> dict[str, str]:
        return bearer(self.settings.admin_token)

    def register_host(self, name: str = "h1") -> dict[str, str]:
        """A new host's Authorization header, for `http`."""
        return bearer(self.register_token(name))

    def count(self, model) -> int:
        with self.db.begin() as s:
            return s.scalar(select(func.count()).select_from(model))

    def stored_files(self) -> list[Path]:
        return [p for p in self.storage_dir.rglob("*") if p.is_file()]

    def rows(self) -> tuple:
        """Every row of every table: equal before and after a request that must change nothing."""
        with self.db.begin() as s:
            return tuple(tuple(map(tuple, s.execute(select(table)).all())) for table in Base.metadata.sorted_tables)


@contextmanager
def scheduler_app(var_dir: Path, r: redis.Redis, **settings) -> Iterator[Scheduler]:
    """The app on a migrated SQLite file and a storage directory under `var_dir`, and the private Redis `r`."""
    var_dir.mkdir(parents=True, exist_ok=True)
    port = r.connection_pool.connection_kwargs["port"]
    configured = Settings(
        var_dir=var_dir,
        database_url=f"sqlite:///{var_dir / 'crowdtrain.db'}",
        redis_url=f"redis://127.0.0.1:{port}/0",
        storage_url=(var_dir / "storage").as_uri(),
        admin_token=ADMIN_TOKEN,
        join_token=JOIN_TOKEN,
        **settings,
    )
    upgrade(configured.resolved_database_url)
    app = create_app(configured)
    with TestClient(app) as http:
        yield Scheduler(app, http, session_factory(configured.resolved_database_url), var_dir / "storage", configured)


@contextmanager
def private_scheduler(tmp: Path, **settings) -> Iterator[Scheduler]:
    """`scheduler_app` under `tmp` with a private Redis of its own, stopped after."""
    port = free_port()
    svc = start_redis(tmp / "redis", port)
    r = redis.Redis(port=port)
    try:
        with scheduler_app(tmp / "var", r, **settings) as sched:
            yield sched
    finally:
        r.close()
        svc.stop()


def write_small_npz(path: Path) -> Path:
    """A dataset that prepares in a blink: 60 examples of 16 features in 3 classes, 12 for validation."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 16)).astype(np.float32), np.arange(60) % 3
    np.savez(path, x=x, y=y, x_val=x[:12], y_val=y[:12])
    return path


def ok(resp: httpx.Response) -> httpx.Response:
    assert resp.status_code < 400, f"{resp.status_code} {resp.text}"
    return resp
