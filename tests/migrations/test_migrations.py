"""The Alembic migrations create exactly the schema the models describe, on SQLite and PostgreSQL."""

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

from migrations import alembic_config, upgrade
from server.models import Base


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
def test_upgrade_head_matches_the_models(database_url: str) -> None:
    upgrade(database_url)
    command.check(alembic_config(database_url))  # raises if models and migrations drift apart
    from server.db import normalize_url

    tables = set(inspect(create_engine(normalize_url(database_url))).get_table_names())
    assert set(Base.metadata.tables) <= tables


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_upgrade_is_idempotent_and_reversible(database_url: str) -> None:
    upgrade(database_url)
    upgrade(database_url)
    command.downgrade(alembic_config(database_url), "base")
    assert set(inspect(create_engine(database_url)).get_table_names()) <= {"alembic_version"}
