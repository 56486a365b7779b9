"""expert-parallel training: replicas of an expert, and the trainers' comparisons of their answers

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29 14:00:00.000000

With a layout's `replicas` r > 1, an expert has r rows, one per replica (0..r-1), each leased to its
own host with its own checkpoint (crowdtrain.server.ledger.experts). Trainers send a sample of their
calls to two replicas and report how many they compared and how many disagreed.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# 0012 made the constraint without a name: PostgreSQL names it so, and SQLite's batch mode names the
# reflected one by this convention.
_POSTGRES_NAME = "experts_mixture_id_uid_key"
_CONVENTION = {"uq": "uq_%(table_name)s_%(column_0_name)s"}
_SQLITE_NAME = "uq_experts_mixture_id"
NEW = "uq_experts_mixture_uid_replica"


def _old_name() -> str:
    return _POSTGRES_NAME if op.get_bind().dialect.name == "postgresql" else _SQLITE_NAME


def upgrade() -> None:
    with op.batch_alter_table("experts", schema=None, naming_convention=_CONVENTION) as batch_op:
        batch_op.add_column(sa.Column("replica", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("calls_compared", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("calls_disagreed", sa.BigInteger(), server_default="0", nullable=False))
        batch_op.drop_constraint(_old_name(), type_="unique")
        batch_op.create_unique_constraint(NEW, ["mixture_id", "uid", "replica"])


def downgrade() -> None:
    op.execute("DELETE FROM experts WHERE replica > 0")
    with op.batch_alter_table("experts", schema=None, naming_convention=_CONVENTION) as batch_op:
        batch_op.drop_constraint(NEW, type_="unique")
        batch_op.create_unique_constraint(_old_name(), ["mixture_id", "uid"])
        batch_op.drop_column("calls_disagreed")
        batch_op.drop_column("calls_compared")
        batch_op.drop_column("replica")
