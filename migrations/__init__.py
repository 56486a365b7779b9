"""Alembic migrations: the only way the schema changes."""

import logging
import threading
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.exc import SQLAlchemyError

from crowdtrain.server.ledger.db import normalize_url

HERE = Path(__file__).resolve().parent


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", normalize_url(database_url).replace("%", "%%"))
    return cfg


def upgrade(database_url: str) -> None:
    """Bring the database to the latest schema (`alembic upgrade head`)."""
    command.upgrade(alembic_config(database_url), "head")


def at_head(database_url: str) -> bool:
    """Whether the database's schema is the latest (False too when the database cannot be reached)."""
    cfg = alembic_config(database_url)
    head = ScriptDirectory.from_config(cfg).get_current_head()
    engine = create_engine(normalize_url(database_url))
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision() == head
    except SQLAlchemyError:
        return False
    finally:
        engine.dispose()


def wait_for_schema(database_url: str, stop: threading.Event, poll_seconds: float = 1.0) -> bool:
    """Wait until the database's schema is the latest (`crowdtrain migrate` or the scheduler brings it
    there), saying so once; False when `stop` is set first."""
    said = False
    while not at_head(database_url):
        if not said:
            logging.getLogger(__name__).info("waiting for the database schema (run `crowdtrain migrate`)")
            said = True
        if stop.wait(poll_seconds):
            return False
    return True
