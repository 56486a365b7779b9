"""join tokens and host revocation

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 07:26:17.772060
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "join_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.Column("hosts_registered", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("join_token_id", sa.Integer(), nullable=True))
        batch_op.create_foreign_key("fk_hosts_join_token_id", "join_tokens", ["join_token_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.drop_constraint("fk_hosts_join_token_id", type_="foreignkey")
        batch_op.drop_column("join_token_id")

    op.drop_table("join_tokens")
