"""replication and reputation: workunit quorum and canonical replica, host refusals and quarantine

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 01:30:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workunits", schema=None) as batch_op:
        batch_op.add_column(sa.Column("quorum", sa.Integer(), server_default="1", nullable=False))
        batch_op.add_column(sa.Column("canonical_assignment_id", sa.Integer(), nullable=True))
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("consecutive_refused", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("quarantined_until", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("quarantine_reason", sa.String(length=500), server_default="", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("quarantine_reason")
        batch_op.drop_column("quarantined_until")
        batch_op.drop_column("consecutive_refused")
    with op.batch_alter_table("workunits", schema=None) as batch_op:
        batch_op.drop_column("canonical_assignment_id")
        batch_op.drop_column("quorum")
