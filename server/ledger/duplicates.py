"""Straggler duplicates: a second assignment of a workunit whose first is slow, and the end of the
one that loses.

At an epoch's tail a job has no ready workunit left while a few assignments still run; an idle
host may then get a duplicate of the oldest of them (`claim_straggler_duplicates`). A workunit
never has more than two live assignments (in progress or uploaded), so it is duplicated at most
once at a time. The first valid result of either is merged; W_s takes one result per workunit
(crowdtrain.server.paramstore.merging.merge_batch), and the other assignment ends `superseded`
(`supersede_siblings` when the winner's merge is recorded, `supersede_result` when the loser's own
merge finds its workunit taken): not merged, not charged, not credited. The workunit is done once.
"""

import logging
from datetime import datetime, timedelta

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session, aliased, sessionmaker

from crowdtrain.core.logs import ids
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.models import Assignment, Host, Job, Shard, Workunit, utcnow

log = logging.getLogger(__name__)

LIVE = (AssignmentStatus.in_progress.value, AssignmentStatus.uploaded.value)


def claim_straggler_duplicates(
    s: Session, job: Job, host: Host, limit: int, running_for: float, now: datetime | None = None
) -> list[tuple[Workunit, Shard]]:
    """Lock up to `limit` in-progress workunits of `job` to duplicate for `host`, oldest straggler
    first: each has exactly one live assignment, in progress for at least `running_for` seconds on
    another host. The caller opens the duplicates (crowdtrain.server.ledger.claims.open_assignments) in `s`.

    Only for a job with nothing ready to give. Workunit rows are locked with SKIP LOCKED like any
    claim, and their live assignments counted again once locked: under READ COMMITTED the first
    query's snapshot may predate a duplicate another scheduler committed meanwhile.
    """
    now = now or utcnow()
    other = aliased(Assignment)
    alone = ~exists().where(
        other.workunit_id == Assignment.workunit_id, other.id != Assignment.id, other.status.in_(LIVE)
    )
    candidates = s.scalars(
        select(Workunit)
        .join(Assignment, Assignment.workunit_id == Workunit.id)
        .where(
            Workunit.job_id == job.id,
            Workunit.status == WorkunitStatus.in_progress.value,
            Workunit.quorum == 1,  # a replicated workunit gets replicas (ledger.replicas), not duplicates
            Assignment.status == AssignmentStatus.in_progress.value,
            Assignment.host_id != host.id,
            Assignment.sent_at <= now - timedelta(seconds=running_for),
            alone,
        )
        .order_by(Assignment.sent_at, Assignment.id)
        .limit(limit)
        .with_for_update(of=Workunit, skip_locked=True)
    ).all()
    if not candidates:
        return []
    live = s.execute(
        select(Assignment.workunit_id, func.count(), func.min(Assignment.host_id))
        .where(Assignment.workunit_id.in_([wu.id for wu in candidates]), Assignment.status.in_(LIVE))
        .group_by(Assignment.workunit_id)
    ).all()
    still_alone = {wu_id for wu_id, n, holder in live if n == 1 and holder != host.id}
    claimed = [wu for wu in candidates if wu.id in still_alone and wu.status == WorkunitStatus.in_progress.value]
    shards = {sh.id: sh for sh in s.scalars(select(Shard).where(Shard.id.in_({wu.shard_id for wu in claimed})))}
    return [(wu, shards[wu.shard_id]) for wu in claimed]


def lock_siblings(s: Session, a: Assignment) -> list[Assignment]:
    """Lock the other live assignments of `a`'s workunit (its duplicate or its straggler), by id.
    Called right after `a` is locked: lock order assignment -> host -> workunit -> job."""
    return list(
        s.scalars(
            select(Assignment)
            .where(Assignment.workunit_id == a.workunit_id, Assignment.id != a.id, Assignment.status.in_(LIVE))
            .order_by(Assignment.id)
            .with_for_update()
        ).all()
    )


def supersede_siblings(s: Session, winner: Assignment, siblings: list[Assignment]) -> list[str]:
    """End `superseded` the live `siblings` (from `lock_siblings`) of `winner`, which was merged.
    Returns the upload keys of those that had uploaded, to delete after the commit."""
    uploads = []
    for other in siblings:
        if other.status not in LIVE:
            continue
        if other.upload_key:
            uploads.append(other.upload_key)
        _supersede(other, winner.id)
    return uploads


def supersede_result(db: sessionmaker[Session], assignment_id: int, winner_id: int | None) -> str | None:
    """An uploaded result whose workunit W_s already holds from another assignment (`winner_id`, when
    known) ends `superseded`; returns its upload key to delete. None, and nothing done, when it is no
    longer uploaded (the winner's record ended it first, or a redelivered task)."""
    with db.begin() as s:
        a = s.get_one(Assignment, assignment_id, with_for_update=True)
        if a.status != AssignmentStatus.uploaded.value:
            return None
        _supersede(a, winner_id)
        wu = s.get_one(Workunit, a.workunit_id, with_for_update=True)
        if wu.status == WorkunitStatus.in_progress.value and not _holder(s, wu.id):
            _release(wu, "the merge of the result that superseded it failed on the server")
        return a.upload_key


# An assignment in one of these holds its workunit: it runs, waits for its merge, or was merged.
HOLDING = (*LIVE, AssignmentStatus.merged.value, AssignmentStatus.validated.value)


def _holder(s: Session, workunit_id: int) -> int | None:
    """An assignment that holds `workunit_id` (HOLDING), if any."""
    return s.scalar(
        select(Assignment.id).where(Assignment.workunit_id == workunit_id, Assignment.status.in_(HOLDING)).limit(1)
    )


def _release(wu: Workunit, why: str) -> None:
    """An in-progress workunit that no assignment holds is ready again."""
    states.move(wu, WorkunitStatus.ready)
    log.warning(
        "workunit %s: in progress with no assignment holding it (%s); ready again",
        wu.id,
        why,
        extra=ids(job_id=wu.job_id, epoch=wu.epoch, workunit_id=wu.id),
    )


def release_orphaned_workunits(db: sessionmaker[Session], job_modes: tuple[str, ...], limit: int = 500) -> int:
    """The transitioner's repair: in-progress workunits of running jobs (of `job_modes`) that no
    assignment holds any more (a race between a winner's failed merge and its duplicate's end, or
    any other lost step) are ready again, so their epoch can finish. Each is checked again once
    locked: a claim that committed meanwhile holds it. Returns how many were released."""
    held = exists().where(Assignment.workunit_id == Workunit.id, Assignment.status.in_(HOLDING))
    with db.begin() as s:
        candidates = s.scalars(
            select(Workunit.id)
            .join(Job, Job.id == Workunit.job_id)
            .where(
                Workunit.status == WorkunitStatus.in_progress.value,
                Job.status == JobStatus.running.value,
                Job.mode.in_(job_modes),
                ~held,
            )
            .order_by(Workunit.id)
            .limit(limit)
        ).all()
    released = 0
    for workunit_id in candidates:
        with db.begin() as s:
            wu = s.get_one(Workunit, workunit_id, with_for_update=True)
            if wu.status == WorkunitStatus.in_progress.value and not _holder(s, wu.id):
                _release(wu, "found by the transitioner")
                released += 1
    return released


def _supersede(a: Assignment, winner_id: int | None) -> None:
    states.move(a, AssignmentStatus.superseded)
    a.finished_at = utcnow()
    by = "another assignment" if winner_id is None else f"assignment {winner_id}"
    a.message = f"workunit {a.workunit_id} was completed by {by} first; this result is not merged"
    log.info(
        "assignment %s: superseded, %s",
        a.id,
        a.message,
        extra=ids(job_id=a.job_id, workunit_id=a.workunit_id, assignment_id=a.id, host_id=a.host_id),
    )
