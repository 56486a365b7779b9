"""The scheduler app in-process (FastAPI TestClient) on a real SQLite file, a real private Redis and
a storage directory: for API tests that need no separate server, parameter-server or client process."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.settings import Settings
from migrations import upgrade
from server.app import create_app
from server.db import session_factory

ADMIN_TOKEN = "test-admin"
JOIN_TOKEN = "test-join"


@dataclass
class Scheduler:
    http: TestClient
    db: sessionmaker[Session]
    storage_dir: Path
    settings: Settings

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def register_host(self, name: str = "h1") -> dict[str, str]:
        """A new host's Authorization header."""
        resp = self.http.post("/v1/hosts", json={"join_token": JOIN_TOKEN, "name": name})
        resp.raise_for_status()
        return {"Authorization": f"Bearer {resp.json()['host_token']}"}

    def count(self, model) -> int:
        with self.db.begin() as s:
            return s.scalar(select(func.count()).select_from(model))

    def stored_files(self) -> list[Path]:
        return [p for p in self.storage_dir.rglob("*") if p.is_file()]


@contextmanager
def scheduler_app(tmp_path: Path, r: redis.Redis, **settings) -> Iterator[Scheduler]:
    """The app with its settings pointed at `tmp_path` and the private Redis `r`."""
    port = r.connection_pool.connection_kwargs["port"]
    configured = Settings(var_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'crowdtrain.db'}",
                          redis_url=f"redis://127.0.0.1:{port}/0", storage_url=(tmp_path / "storage").as_uri(),
                          admin_token=ADMIN_TOKEN, join_token=JOIN_TOKEN, **settings)
    upgrade(configured.resolved_database_url)
    app = create_app(configured)
    with TestClient(app) as http:
        yield Scheduler(http, session_factory(configured.resolved_database_url), tmp_path / "storage", configured)
