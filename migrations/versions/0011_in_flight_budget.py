"""in-flight budget (backpressure): the merge pace measured at each merge, and the index that counts a
job's assignments by status

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 17:40:00.000000

`jobs.merge_rate` (merges per second) and `jobs.turnaround_seconds` (sent -> uploaded) are measured
over the job's latest merges when each is recorded (crowdtrain.server.ledger.pace); dispatch derives
the job's in-flight budget from them. The index (job_id, status, finished_at) serves both the count
of a job's unmerged assignments in every work request and the latest merges read at each merge.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("merge_rate", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("turnaround_seconds", sa.Float(), nullable=True))
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.create_index("ix_assignments_job_status_finished", ["job_id", "status", "finished_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.drop_index("ix_assignments_job_status_finished")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("turnaround_seconds")
        batch_op.drop_column("merge_rate")
