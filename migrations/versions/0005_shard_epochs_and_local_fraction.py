"""shard epochs and local fraction

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 11:40:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The unique (job_id, index) of 0001 has no name of its own: PostgreSQL calls it
# shards_job_id_index_key, and SQLite's copy is named through this convention when batch mode
# reflects the table.
_UNNAMED = {"uq": "uq_%(table_name)s_%(column_0_name)s_%(column_1_name)s"}


def _old_unique_name() -> str:
    return "uq_shards_job_id_index" if op.get_context().dialect.name == "sqlite" else "shards_job_id_index_key"


def upgrade() -> None:
    # Existing shards are the deal every epoch shares: epoch 0.
    with op.batch_alter_table("shards", schema=None, naming_convention=_UNNAMED) as batch_op:
        batch_op.add_column(sa.Column("epoch", sa.Integer(), server_default="0", nullable=False))
        batch_op.alter_column("sha256", existing_type=sa.String(length=64), nullable=True)
        batch_op.drop_constraint(_old_unique_name(), type_="unique")
        batch_op.create_unique_constraint("uq_shards_job_epoch_index", ["job_id", "epoch", "index"])
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("local_fraction", sa.Float(), server_default="1.0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.drop_column("local_fraction")
    # The old schema has one deal per job: workunits on a re-dealt shard move to the submission's
    # shard of the same index (one per epoch, so still unique), and the re-dealt rows go.
    op.execute(
        "UPDATE workunits SET shard_id = (SELECT s0.id FROM shards s0 JOIN shards se "
        'ON s0.job_id = se.job_id AND s0."index" = se."index" AND s0.epoch = 0 '
        "WHERE se.id = workunits.shard_id) WHERE shard_id IN (SELECT id FROM shards WHERE epoch > 0)"
    )
    op.execute("DELETE FROM shards WHERE epoch > 0")
    with op.batch_alter_table("shards", schema=None, naming_convention=_UNNAMED) as batch_op:
        batch_op.drop_constraint("uq_shards_job_epoch_index", type_="unique")
        batch_op.create_unique_constraint(_old_unique_name(), ["job_id", "index"])
        batch_op.alter_column("sha256", existing_type=sa.String(length=64), nullable=False)
        batch_op.drop_column("epoch")
