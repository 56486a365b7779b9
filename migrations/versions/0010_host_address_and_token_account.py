"""host address and network, join tokens per volunteer account with a registration limit

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 21:45:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("address", sa.String(length=45), server_default="", nullable=False))
        batch_op.add_column(sa.Column("network", sa.String(length=50), server_default="", nullable=False))
        batch_op.create_index("ix_hosts_network_created_at", ["network", "created_at"], unique=False)
    with op.batch_alter_table("join_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("account", sa.String(length=64), server_default="", nullable=False))
        batch_op.add_column(sa.Column("registrations_per_hour", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("join_tokens", schema=None) as batch_op:
        batch_op.drop_column("registrations_per_hour")
        batch_op.drop_column("account")
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_index("ix_hosts_network_created_at")
        batch_op.drop_column("network")
        batch_op.drop_column("address")
