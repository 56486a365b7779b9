"""Engine and session factory. SQLite gets WAL and `BEGIN IMMEDIATE` so that claims are atomic."""

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    """`postgresql://` URLs use psycopg 3, the driver the server extra installs."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
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
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


@lru_cache
def _factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(make_engine(url), expire_on_commit=False)


def session_factory(url: str) -> sessionmaker[Session]:
    return _factory(url)


@contextmanager
def transaction(url: str) -> Iterator[Session]:
    """One unit of work: commits on success, rolls back on any exception."""
    with _factory(url).begin() as session:
        yield session
