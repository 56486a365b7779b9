"""Engine and session factory. SQLite gets WAL and `BEGIN IMMEDIATE` so that claims are atomic."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.settings import get_settings


def normalize_url(url: str) -> str:
    """`postgresql://` URLs use psycopg 3, the driver the server extra installs."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record) -> None:
            # Let SQLAlchemy, not the driver, decide when transactions begin.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL keeps it consistent
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn) -> None:
            # Take the write lock up front: two claims can never read the same ready workunit.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # Every scheduler worker, parameter server and transitioner has its own pool: keep the sum
    # under PostgreSQL's max_connections (100 by default).
    settings = get_settings()
    engine = create_engine(url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow)
    _ping_idle_connections(engine)
    return engine


# A pooled connection that sat idle for this long is pinged before it is lent (the server may have
# restarted or closed it meanwhile).
PING_IDLE_AFTER_S = 1.0


def _ping_idle_connections(engine: Engine) -> None:
    """Ping a connection before it is lent only if it sat idle in the pool for PING_IDLE_AFTER_S;
    a dead one is replaced. SQLAlchemy's `pool_pre_ping` pings on every checkout: a round trip per
    transaction, an eighth of a work request's CPU. A connection that breaks while in constant use
    is still caught: its statement fails, and SQLAlchemy then replaces every connection of the pool."""

    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_conn, record) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn, record, _proxy) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None or time.monotonic() - idle_since < PING_IDLE_AFTER_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as error:
            raise exc.DisconnectionError(f"idle pooled connection is gone: {error}") from error


_factories: dict[str, sessionmaker[Session]] = {}
_factories_lock = threading.Lock()


def session_factory(url: str) -> sessionmaker[Session]:
    """One engine (one connection pool) per database URL and process.

    Locked, not lru_cache'd: a burst of first requests on a fresh worker would otherwise build
    an engine each and exhaust the database's connections.
    """
    with _factories_lock:
        if url not in _factories:
            _factories[url] = sessionmaker(make_engine(url), expire_on_commit=False)
        return _factories[url]


@contextmanager
def transaction(url: str) -> Iterator[Session]:
    """One unit of work: commits on success, rolls back on any exception."""
    with session_factory(url).begin() as session:
        yield session
