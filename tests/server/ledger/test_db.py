"""The PostgreSQL pool pings a connection only when it sat idle, and replaces one the server closed."""

import time

import pytest
from sqlalchemy import create_engine, select, text

from crowdtrain.server.ledger import db


@pytest.fixture
def engine(postgres_url: str):
    engine = db.make_engine(postgres_url)
    yield engine
    engine.dispose()


@pytest.fixture
def pings(engine, monkeypatch) -> list[object]:
    """The pings the pool sends (the dialect's own ping, counted as it runs)."""
    sent: list[object] = []
    ping = engine.dialect.do_ping

    def counted(dbapi_conn):
        sent.append(dbapi_conn)
        return ping(dbapi_conn)

    monkeypatch.setattr(engine.dialect, "do_ping", counted)
    return sent


def _backend_pid(engine) -> int:
    with engine.connect() as c:
        return c.execute(text("select pg_backend_pid()")).scalar_one()


def test_a_connection_in_constant_use_is_not_pinged(engine, pings, monkeypatch) -> None:
    monkeypatch.setattr(db, "PING_IDLE_AFTER_S", 60.0)
    pids = {_backend_pid(engine) for _ in range(20)}
    assert len(pids) == 1  # the same pooled connection every time
    assert pings == []


def test_a_connection_idle_past_the_threshold_is_pinged_and_replaced_if_the_server_closed_it(
    engine, pings, postgres_url: str, monkeypatch
) -> None:
    monkeypatch.setattr(db, "PING_IDLE_AFTER_S", 0.05)
    first = _backend_pid(engine)
    admin = create_engine(db.normalize_url(postgres_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        assert c.execute(select(text("pg_terminate_backend(:pid)")), {"pid": first}).scalar_one()
    admin.dispose()
    time.sleep(0.1)

    second = _backend_pid(engine)  # no error: the ping found the connection gone and the pool made a new one

    assert second != first
    assert len(pings) == 1
