"""expert-parallel training: mixtures and their experts, with leases and checkpoints

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29 08:10:00.000000

A mixture is the layout of a model's mixture-of-experts layers; each of its experts is leased to an
expert host (host_id, url, lease_expires_at) and checkpointed to object storage (checkpoint_key,
checkpoint_step). route_version orders the changes of the routing table that trainers follow.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mixtures",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("layout", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("route_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "experts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("mixture_id", sa.Integer(), nullable=False),
        sa.Column("uid", sa.String(length=40), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=True),
        sa.Column("url", sa.String(length=300), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("route_version", sa.Integer(), nullable=False),
        sa.Column("leases", sa.Integer(), nullable=False),
        sa.Column("checkpoint_key", sa.String(length=500), nullable=True),
        sa.Column("checkpoint_step", sa.Integer(), nullable=False),
        sa.Column("checkpoint_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["host_id"], ["hosts.id"]),
        sa.ForeignKeyConstraint(["mixture_id"], ["mixtures.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("mixture_id", "uid"),
    )
    with op.batch_alter_table("experts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_experts_host_id"), ["host_id"], unique=False)
        batch_op.create_index("ix_experts_lease_expires_at", ["lease_expires_at"], unique=False)
        batch_op.create_index("ix_experts_mixture_route_version", ["mixture_id", "route_version"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("experts", schema=None) as batch_op:
        batch_op.drop_index("ix_experts_mixture_route_version")
        batch_op.drop_index("ix_experts_lease_expires_at")
        batch_op.drop_index(batch_op.f("ix_experts_host_id"))
    op.drop_table("experts")
    op.drop_table("mixtures")
