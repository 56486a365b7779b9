"""claim index

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 08:10:51.124558
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workunits", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_workunits_job_status"))
        batch_op.create_index("ix_workunits_claim", ["job_id", "status", "epoch", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("workunits", schema=None) as batch_op:
        batch_op.drop_index("ix_workunits_claim")
        batch_op.create_index(batch_op.f("ix_workunits_job_status"), ["job_id", "status"], unique=False)
