"""host frameworks

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 19:20:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Hosts registered before this column existed ran PyTorch only.
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("frameworks", sa.String(length=100), server_default="pytorch", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_column("frameworks")
