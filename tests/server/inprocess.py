"""The scheduler app inside the test process (FastAPI TestClient): a real SQLite file, file storage and
a real Redis, without the seconds a Cluster's processes take to start. For API-level checks."""

import secrets
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from crowdtrain.settings import Settings
from migrations import upgrade
from server.app import create_app


@dataclass
class Scheduler:
    app: FastAPI
    settings: Settings

    def client(self, token: str | None = None, address: str = "testclient") -> TestClient:
        """A caller from `address`, with `token` as its bearer token (none if None)."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return TestClient(self.app, headers=headers, client=(address, 50000))

    def admin(self, address: str = "testclient") -> TestClient:
        return self.client(self.settings.admin_token, address)

    def register(self, name: str, address: str = "testclient") -> TestClient:
        """A newly registered host, as a client carrying its host token."""
        resp = self.client(address=address).post("/v1/hosts", json={"join_token": self.settings.join_token,
                                                                      "name": name})
        assert resp.status_code == 201, resp.text
        return self.client(resp.json()["host_token"], address)


def start_scheduler(var_dir: Path, redis_url: str, **settings) -> Scheduler:
    """The app on a migrated SQLite database under `var_dir`, with random tokens unless given."""
    config = Settings(var_dir=var_dir, redis_url=redis_url, admin_token=secrets.token_urlsafe(32),
                      join_token=secrets.token_urlsafe(32), database_url="", storage_url="", **settings)
    var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(config.resolved_database_url)
    return Scheduler(create_app(config), config)


def redis_url_of(r) -> str:
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw['port']}/0"


def ok(resp: httpx.Response) -> httpx.Response:
    assert resp.status_code < 400, f"{resp.status_code} {resp.text}"
    return resp
