"""Alembic migrations: the only way the schema changes."""

from pathlib import Path

from alembic import command
from alembic.config import Config

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
