"""expert-parallel training: what trainers report of their calls to each expert

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 11:00:00.000000

Trainers report, per expert and host, the calls answered (and the rows they carried), failed, dropped
late and refused (crowdtrain.server.ledger.expert_calls.record_calls): the expert's counts, and the span of
the reports that gave them, are the operator's request and failure rates; the host's credit and
charges are kept on the host's row as for results.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

COUNTS = ("calls_answered", "calls_failed", "calls_late", "calls_refused", "rows_answered")


def upgrade() -> None:
    with op.batch_alter_table("experts", schema=None) as batch_op:
        for name in COUNTS:
            batch_op.add_column(sa.Column(name, sa.BigInteger(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("reported_from", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("reported_to", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("experts", schema=None) as batch_op:
        batch_op.drop_column("reported_to")
        batch_op.drop_column("reported_from")
        for name in reversed(COUNTS):
            batch_op.drop_column(name)
