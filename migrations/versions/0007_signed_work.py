"""signed work: job recipes and their signatures, the project's public keys

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 10:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Jobs from before this revision have no recipe: they run unsigned, as they always did.
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("recipe", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("recipe_public_key", sa.String(length=44), nullable=True))
        batch_op.add_column(sa.Column("recipe_signature", sa.String(length=88), nullable=True))
    op.create_table(
        "project_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("public_key", sa.String(length=44), nullable=False),
        sa.Column("rotation_signature", sa.String(length=88), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("public_key"),
    )


def downgrade() -> None:
    op.drop_table("project_keys")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("recipe_signature")
        batch_op.drop_column("recipe_public_key")
        batch_op.drop_column("recipe")
