"""Failed authentication is throttled per client address, in Redis, for every kind of credential."""

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from crowdtrain.core import keys
from crowdtrain.launch.cluster import Service, crowdtrain_argv, free_port, start_redis, wait_for
from crowdtrain.server.services.throttle import WINDOW_SECONDS
from tests.server.inprocess import private_scheduler, scheduler_app

LIMIT = 3


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    with private_scheduler(tmp_path_factory.mktemp("throttle"), auth_failures_per_minute=LIMIT) as app:
        yield app


def _join(sched, token: str, address: str):
    return sched.client(address=address).post("/v1/hosts", json={"join_token": token, "name": "h"})


GUESSES = {
    "join": lambda s, addr: _join(s, "guess", addr),
    "admin": lambda s, addr: s.client("guess", addr).get("/v1/jobs"),
    "host": lambda s, addr: s.client("guess", addr).post("/v1/work", json={"free_slots": 1}),
}


@pytest.mark.parametrize("kind", sorted(GUESSES))
def test_an_address_that_keeps_guessing_is_answered_429_until_its_window_ends(sched, kind) -> None:
    address = f"10.0.0.{sorted(GUESSES).index(kind) + 1}"
    first = [GUESSES[kind](sched, address).status_code for _ in range(LIMIT)]
    assert first == [403 if kind == "join" else 401] * LIMIT
    throttled = GUESSES[kind](sched, address)
    assert throttled.status_code == 429 and "too many failed authentications" in throttled.json()["detail"]
    assert 0 < int(throttled.headers["Retry-After"]) <= WINDOW_SECONDS
    # Other addresses are not affected.
    assert _join(sched, sched.settings.join_token, "10.0.1.1").status_code == 201
    assert sched.admin("10.0.1.1").get("/v1/jobs").status_code == 200


def test_successes_and_missing_credentials_are_not_counted(sched) -> None:
    address = "10.0.2.1"
    host = sched.register("busy", address)
    for _ in range(3 * LIMIT):
        assert host.post("/v1/work", json={"free_slots": 0}).status_code == 200
        assert sched.client(address=address).post("/v1/work", json={"free_slots": 0}).status_code == 401
    assert [GUESSES["admin"](sched, address).status_code for _ in range(LIMIT)] == [401] * LIMIT
    assert GUESSES["host"](sched, address).status_code == 429


def test_a_right_token_from_a_throttled_address_is_admitted(sched) -> None:
    """One guesser behind a NAT must not lock out the volunteers and operator behind it: only failures
    are throttled, and a credential is checked before the address's failures are."""
    address = "10.0.4.1"
    host = sched.register("behind-the-nat", address)
    assert [GUESSES["host"](sched, address).status_code for _ in range(LIMIT + 2)] == [401] * LIMIT + [429] * 2
    assert host.post("/v1/work", json={"free_slots": 0}).status_code == 200
    assert sched.admin(address).get("/v1/jobs").status_code == 200
    assert _join(sched, sched.settings.join_token, address).status_code == 201
    login = sched.client(address=address).post(
        "/dashboard/login", data={"token": sched.settings.admin_token}, follow_redirects=False
    )
    assert login.status_code == 303
    # ... while every kind of wrong credential from there is still answered 429.
    assert {GUESSES[kind](sched, address).status_code for kind in GUESSES} == {429}
    wrong_login = sched.client(address=address).post("/dashboard/login", data={"token": "guess"})
    assert wrong_login.status_code == 429


def test_the_budget_is_shared_by_every_scheduler_process_through_redis(sched, tmp_path) -> None:
    address = "10.0.3.1"
    r = redis.Redis.from_url(sched.settings.redis_url)
    with scheduler_app(tmp_path / "var", r, auth_failures_per_minute=LIMIT) as other_worker:
        for s in (sched, other_worker, sched):
            assert GUESSES["join"](s, address).status_code == 403
        assert GUESSES["join"](other_worker, address).status_code == 429
    assert int(r.get(keys.auth_failures(address))) == LIMIT and 0 < r.ttl(keys.auth_failures(address)) <= 60


# --- behind uvicorn: which address is the client's ----------------------------------------------

SERVED_LIMIT = 20  # the default of CROWDTRAIN_AUTH_FAILURES_PER_MINUTE


@contextmanager
def served_scheduler(tmp: Path, **env: str) -> Iterator[str]:
    """`crowdtrain server` (uvicorn, as deployed) on a private Redis and a SQLite file; its URL.
    TestClient runs no uvicorn, hence none of its proxy-header handling: this is the real one."""
    redis_port, port = free_port(), free_port()
    backing = start_redis(tmp / "redis", redis_port)
    settings_env = {
        "CROWDTRAIN_VAR_DIR": str(tmp / "var"),
        "CROWDTRAIN_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "CROWDTRAIN_ADMIN_TOKEN": secrets.token_urlsafe(32),
        "CROWDTRAIN_JOIN_TOKEN": secrets.token_urlsafe(32),
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("CROWDTRAIN_") and k != "FORWARDED_ALLOW_IPS"}
    server = Service(
        "server", crowdtrain_argv("server", "--port", str(port)), base | settings_env | env, tmp / "server.log"
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return httpx.get(f"{url}/v1/health/live", timeout=2).status_code > 0
        except httpx.HTTPError:
            return False

    try:
        server.start()
        wait_for(answers, 60, "the scheduler did not come up", server)
        yield url
    finally:
        server.stop()
        backing.stop()


def _guesses(url: str, forwarded_for: list[str]) -> list[int]:
    """Wrong admin tokens, one per X-Forwarded-For value."""
    with httpx.Client(base_url=url, timeout=10) as http:
        return [
            http.get("/v1/jobs", headers={"Authorization": "Bearer guess", "X-Forwarded-For": ip}).status_code
            for ip in forwarded_for
        ]


ROTATING = [f"203.0.113.{i}" for i in range(200)]


def test_a_rotating_forwarded_for_does_not_escape_the_throttle_without_a_trusted_proxy(tmp_path) -> None:
    """uvicorn believes X-Forwarded-For from 127.0.0.1 by default; with no trusted proxy configured the
    connecting peer is the client, whatever the header says."""
    with served_scheduler(tmp_path) as url:
        codes = _guesses(url, ROTATING)
    assert codes == [401] * SERVED_LIMIT + [429] * (len(ROTATING) - SERVED_LIMIT)


def test_a_trusted_proxy_names_the_client(tmp_path) -> None:
    with served_scheduler(tmp_path, CROWDTRAIN_TRUSTED_PROXIES="127.0.0.1/32") as url:
        assert _guesses(url, ROTATING[: 2 * SERVED_LIMIT]) == [401] * 2 * SERVED_LIMIT  # as many clients
        one = _guesses(url, ["192.0.2.7"] * (SERVED_LIMIT + 1))
        assert one == [401] * SERVED_LIMIT + [429]  # ... and each one is throttled on its own
