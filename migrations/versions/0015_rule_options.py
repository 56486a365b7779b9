"""the merge rules' options: each stored job's `assimilation` section keeps its own rule's options only

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01 08:00:00.000000

The job spec's `assimilation` section became one model per merge rule (crowdtrain.core.assimilationspec),
and a section holding another rule's option is refused. Jobs stored before held every rule's options
side by side (the flat model dumped them all, defaults included), which no rule read: they are dropped
here, so that a stored spec reads as it would be written now. What a rule reads is unchanged. The
options are listed as they were at this revision, not imported, so later changes to the models leave
this migration as it is.
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_POLICY = {
    "rule",
    "clip_norm",
    "upload",
    "max_staleness",
    "max_update_norm",
    "update_norm_factor",
    "update_norm_warmup",
    "divergence_factor",
    "divergence_patience",
    "min_update_spread",
}
_STEPPING = {
    "server_lr",
    "staleness_weight",
    "staleness_a",
    "staleness_b",
    "step_control",
    "step_floor",
    "outer_optimizer",
    "outer_momentum",
    "nesterov_delay",
    "adam_betas",
    "adam_eps",
}
_KEPT = {
    "vc-asgd": _POLICY | {"schedule", "alpha"},
    "delta": _POLICY | _STEPPING,
    "fedbuff": _POLICY | _STEPPING | {"buffer_size", "combiner", "trim_fraction"},
}

_jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("spec", sa.JSON))


def _own_options(assimilation: dict[str, Any]) -> dict[str, Any]:
    kept = _KEPT.get(assimilation.get("rule", ""))
    return assimilation if kept is None else {k: v for k, v in assimilation.items() if k in kept}


def upgrade() -> None:
    bind = op.get_bind()
    for job_id, spec in bind.execute(sa.select(_jobs.c.id, _jobs.c.spec)).all():
        assimilation = (spec or {}).get("assimilation")
        if isinstance(assimilation, dict) and _own_options(assimilation) != assimilation:
            new = {**spec, "assimilation": _own_options(assimilation)}
            bind.execute(_jobs.update().where(_jobs.c.id == job_id).values(spec=new))


def downgrade() -> None:
    """Nothing to undo: the flat model read a missing option as its default, which no rule read."""
