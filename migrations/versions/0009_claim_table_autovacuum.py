"""claim tables vacuumed often: autovacuum storage parameters for workunits and assignments

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 05:30:00.000000

Every claim updates a workunit row (ready -> in progress) and inserts an assignment, and every
result updates both again. PostgreSQL's defaults vacuum a table once a fifth of its rows are dead:
for a job of 200,000 workunits that is 40,000 dead versions, whose entries the claim index keeps and
every SKIP LOCKED scan walks past, so claims slow down until vacuum runs. These tables are vacuumed
after about 1% of their rows (and at least 1,000) have changed, with a shorter cost delay so that a
vacuum keeps up with the claims. SQLite has no such parameters (nothing to do there).
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TABLES = ("workunits", "assignments")
PARAMETERS = {
    "autovacuum_vacuum_scale_factor": "0.01",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_delay": "1",
}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    settings = ", ".join(f"{name} = {value}" for name, value in PARAMETERS.items())
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} SET ({settings})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} RESET ({', '.join(PARAMETERS)})")
