"""Claims: moving ready workunits of a job to in progress for one host, in the order of its
preferences (cached shards, then retried or fresh workunits by its reliability, then any), and
opening their assignments. Both run on a plain Connection, in the caller's transaction, with
statements built once per process: they are the common path of every work request
(crowdtrain.server.services.dispatch)."""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, Connection, Update, bindparam, insert, select, update

from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.models import Assignment, Shard, Workunit

RELIABLE_AFTER = 3  # consecutive valid results before a host gets retried workunits first


@dataclass(frozen=True)
class Claim:
    """A workunit claimed for a host (moved to in progress, or a straggler or replica to duplicate),
    with what its assignment says of its shard: plain values, no ORM object."""

    workunit_id: int
    epoch: int
    shard_id: int
    shard_index: int
    shard_epoch: int
    shard_key: str
    shard_sha256: str | None
    shard_size: int

    @classmethod
    def of(cls, wu: Workunit, shard: Shard) -> "Claim":
        return cls(wu.id, wu.epoch, shard.id, shard.index, shard.epoch, shard.key, shard.sha256, shard.size)


# A claim moves a workunit from ready to in progress: the one transition its statement makes.
assert states.can_move(WorkunitStatus, WorkunitStatus.ready, WorkunitStatus.in_progress)


def _claim_statement(extra: ColumnElement[bool] | None) -> Update:
    ready = (
        select(Workunit.id)
        .where(Workunit.job_id == bindparam("claim_job"), Workunit.status == WorkunitStatus.ready.value)
        .order_by(Workunit.epoch, Workunit.id)
        .limit(bindparam("claim_limit"))
        .with_for_update(skip_locked=True)
    )
    if extra is not None:
        ready = ready.where(extra)
    # Updated by the same statement: a later preference's statement in this transaction (which
    # SKIP LOCKED does not stop, the locks being its own) no longer sees these rows ready.
    return (
        update(Workunit)
        .where(Workunit.id.in_(ready.scalar_subquery()))
        .values(status=WorkunitStatus.in_progress.value)
        .returning(Workunit.id, Workunit.epoch, Workunit.shard_id)
    )


# Built once: a work request runs some of these on every call, and building SQLAlchemy expressions
# costs more CPU than executing them.
_CLAIM = {
    "cached": _claim_statement(
        Workunit.shard_id.in_(
            select(Shard.id).where(
                Shard.job_id == bindparam("claim_job"), Shard.sha256.in_(bindparam("claim_cached", expanding=True))
            )
        )
    ),
    "retried": _claim_statement(Workunit.error_count > 0),
    "fresh": _claim_statement(Workunit.error_count == 0),
    "any": _claim_statement(None),
}
_SHARDS = select(Shard.id, Shard.index, Shard.epoch, Shard.key, Shard.sha256, Shard.size).where(
    Shard.id.in_(bindparam("ids", expanding=True))
)


def claim_workunits(c: Connection, job_id: int, reliable: bool, limit: int, cached: list[str]) -> list[Claim]:
    """Claim up to `limit` ready workunits of the job in the transaction of `c`: locked (concurrent
    claimers skip each other's rows) and moved to in progress by one statement per preference; then
    their shards are read by one more.

    Preferences are tried as separate statements, each an index range scan on (job, status, epoch, id):
    first workunits whose shard the host has cached (sha256 in `cached`), then retried workunits if
    the host is `reliable` (fresh ones if it is not), then any. One query ordering by all the
    preferences at once would sort every ready workunit of the job on each request.
    """
    preferences = (["cached"] if cached else []) + ["retried" if reliable else "fresh", "any"]
    claimed: list[tuple[int, int, int]] = []  # (workunit id, epoch, shard id)
    for preference in preferences:
        if len(claimed) >= limit:
            break
        params: dict[str, object] = {"claim_job": job_id, "claim_limit": limit - len(claimed)}
        if preference == "cached":
            params["claim_cached"] = cached
        rows = c.execute(_CLAIM[preference], params).all()
        claimed += sorted(((wu_id, epoch, shard_id) for wu_id, epoch, shard_id in rows), key=lambda w: (w[1], w[0]))
    if not claimed:
        return []
    # Rows are read by position: a row's `index` would be the tuple method, not the column.
    shards = {row[0]: row for row in c.execute(_SHARDS, {"ids": sorted({shard_id for _, _, shard_id in claimed})})}
    return [Claim(wu_id, epoch, *shards[shard_id]) for wu_id, epoch, shard_id in claimed]


_OPEN_ASSIGNMENT = insert(Assignment).returning(Assignment.workunit_id, Assignment.id, sort_by_parameter_order=True)


def open_assignments(
    c: Connection,
    claims: list[Claim],
    job_id: int,
    host_id: int,
    base_version: int,
    local_fraction: float,
    sent_at: datetime,
    deadline: datetime,
) -> dict[int, int]:
    """Create the in-progress assignments of the `claims` for `host_id`, starting from the job's
    published snapshot `base_version`, in the transaction of `c`: workunit id -> assignment id."""
    if not claims:
        return {}
    rows = c.execute(
        _OPEN_ASSIGNMENT,
        [
            {
                "workunit_id": cl.workunit_id,
                "job_id": job_id,
                "host_id": host_id,
                "base_version": base_version,
                "local_fraction": local_fraction,
                "status": AssignmentStatus.in_progress.value,
                "sent_at": sent_at,
                "deadline": deadline,
            }
            for cl in claims
        ],
    ).all()
    return {workunit_id: assignment_id for workunit_id, assignment_id in rows}
