"""Failed authentication is throttled per client address, in Redis, for every kind of credential."""

import pytest
import redis

from crowdtrain.core import keys
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
    # Guessing stops rather than slows: the right token is not even checked from that address.
    assert _join(sched, sched.settings.join_token, address).status_code == 429
    assert sched.admin(address).get("/v1/jobs").status_code == 429
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
    assert host.post("/v1/work", json={"free_slots": 0}).status_code == 429


def test_the_budget_is_shared_by_every_scheduler_process_through_redis(sched, tmp_path) -> None:
    address = "10.0.3.1"
    r = redis.Redis.from_url(sched.settings.redis_url)
    with scheduler_app(tmp_path / "var", r, auth_failures_per_minute=LIMIT) as other_worker:
        for s in (sched, other_worker, sched):
            assert GUESSES["join"](s, address).status_code == 403
        assert GUESSES["join"](other_worker, address).status_code == 429
    assert int(r.get(keys.auth_failures(address))) == LIMIT and 0 < r.ttl(keys.auth_failures(address)) <= 60
