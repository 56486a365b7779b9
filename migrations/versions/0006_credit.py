"""credit: training FLOPs per example, host accounts and credit, credit per merged result

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 01:05:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Jobs submitted before this revision have no FLOP count: their results earn no credit.
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("training_flops", sa.BigInteger(), server_default="0", nullable=False))
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("account", sa.String(length=64), server_default="", nullable=False))
        batch_op.add_column(sa.Column("credit", sa.Float(), server_default="0", nullable=False))
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("credit", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.drop_column("credit")
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("credit")
        batch_op.drop_column("account")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("training_flops")
