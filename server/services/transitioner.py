"""The transitioner: times out assignments past their deadline, re-queues merges that stalled (or
ends them, once their job no longer runs), closes replica votes that no replica comes for, makes
ready again the workunits no assignment holds, and closes epochs whose closing was lost."""

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import redis
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, aliased, sessionmaker

from crowdtrain.core import merge_stages
from crowdtrain.core.jobspec import WORKUNIT_MODES
from crowdtrain.core.merge_stages import Stamps
from crowdtrain.core.states import AssignmentStatus, JobStatus
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger import duplicates, replicas
from crowdtrain.server.ledger import jobs as ledger_jobs
from crowdtrain.server.ledger.assignments import time_out_expired
from crowdtrain.server.ledger.epochs import close_epoch_if_complete, close_epochs_after_failure
from crowdtrain.server.ledger.exports import export_pending_models
from crowdtrain.server.ledger.job_end import Evaluator, reopen_abandoned_merges
from crowdtrain.server.ledger.models import Assignment, Job, Workunit, utcnow
from crowdtrain.server.services import experts, telemetry

log = logging.getLogger(__name__)


def reap_expired_assignments(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    evaluator: Evaluator,
    now: datetime,
    limit: int = 500,
) -> int:
    """Mark in-progress assignments past their deadline at `now` timed_out; their workunits retry or
    fail, and the epochs of those that failed are closed (crowdtrain.server.ledger.assignments.time_out_expired)."""
    expired = time_out_expired(db, storage, r, evaluator, limit, now)
    telemetry.count(r, "timeouts", expired)
    return expired


def close_stalled_votes(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, evaluator: Evaluator, now: datetime
) -> int:
    """Close, inconclusive, the replica votes that waited past their bound for a replica no host took
    by `now` (crowdtrain.server.ledger.replicas.close_stalled_votes): their results are deleted, and the
    epochs of workunits that failed for it are closed. Returns how many votes were closed."""
    closed = replicas.close_stalled_votes(db, now)
    for vote in closed:
        for key in vote.ended:
            storage.delete(key)
    close_epochs_after_failure(db, storage, r, [(v.job_id, v.epoch) for v in closed if v.failed], evaluator)
    return len(closed)


def close_finished_epochs(db: sessionmaker[Session], storage: Storage, r: redis.Redis, evaluator: Evaluator) -> None:
    """Close epochs whose last workunit finished but whose closing was lost (a crash or a database
    race in the parameter server that did the last merge). Closing is idempotent. DeDLOC jobs have no
    epochs of workunits: their rounds end their steps, not this sweep."""
    with db.begin() as s:
        jobs = s.execute(
            select(Job.id, Job.current_epoch).where(Job.status == JobStatus.running.value, Job.mode.in_(WORKUNIT_MODES))
        ).all()
    for job_id, current in jobs:
        for epoch in (current - 1, current):
            if epoch >= 1:
                close_epoch_if_complete(db, storage, r, job_id, epoch, evaluator)


def requeue_stalled_merges(
    db: sessionmaker[Session], stalled_after: float, enqueue: Callable[[int, Stamps], None], now: datetime
) -> int:
    """Queue again the merge of results uploaded long ago and still not merged (a lost task), for
    running jobs only: a finished or cancelled job's results are ended instead (end_stalled_uploads).
    A replica that waits for the rest of its quorum (crowdtrain.server.ledger.replicas) is not stalled."""
    replica = aliased(Assignment)
    uploaded = (
        select(func.count())
        .where(replica.workunit_id == Workunit.id, replica.status == AssignmentStatus.uploaded.value)
        .correlate(Workunit)
        .scalar_subquery()
    )
    with db.begin() as s:
        rows = s.execute(
            select(Assignment.id, Assignment.uploaded_at)
            .join(Job, Job.id == Assignment.job_id)
            .join(Workunit, Workunit.id == Assignment.workunit_id)
            .where(
                Job.status == JobStatus.running.value,
                Assignment.status == AssignmentStatus.uploaded.value,
                Assignment.uploaded_at < now - timedelta(seconds=stalled_after),
                or_(Workunit.quorum == 1, Workunit.canonical_assignment_id.is_not(None), uploaded >= Workunit.quorum),
            )
            .limit(500)
        ).all()
    for aid, uploaded_at in rows:
        assert uploaded_at is not None  # the query selects uploaded assignments only
        log.warning(
            "assignment %s: uploaded at %s and still not merged; queueing its merge again",
            aid,
            uploaded_at.isoformat(timespec="seconds"),
        )
        enqueue(aid, merge_stages.received(uploaded_at.replace(tzinfo=UTC).timestamp()))
    return len(rows)


def end_stalled_uploads(
    db: sessionmaker[Session],
    r: redis.Redis,
    stalled_after: float,
    enqueue: Callable[[int, Stamps], None],
    now: datetime,
) -> int:
    """End the results that stayed unmerged long after upload while their job stopped running: their
    merge task was lost. The job's merges are closed first, so the set W_s holds is final: a result
    in it has its merge queued again (the task records it), any other is rejected, uncharged.
    Returns how many were rejected."""
    ended, held = ledger_jobs.end_stalled_uploads(db, r, now - timedelta(seconds=stalled_after))
    for aid in held:
        log.warning("assignment %s: W_s holds it but the ledger does not yet; queueing its merge again", aid)
        enqueue(aid, merge_stages.received())
    if ended:
        log.warning("%d results of jobs no longer running were never merged; rejected them", ended)
    return ended


def sweep(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    evaluator: Evaluator,
    now: datetime,
    stalled: tuple[float, Callable[[int, Stamps], None]] | None = None,
) -> None:
    """One pass of the transitioner at `now` (naive UTC): deadlines, stalled votes, orphaned workunits,
    epochs whose closing was lost, merges a dead process left closed, pending exports, expert leases;
    with `stalled` (stalled_after seconds, enqueue), the merges stalled that long are queued again or
    ended. Time is this argument, not the clock: a test passes a later `now` instead of waiting."""
    reap_expired_assignments(db, storage, r, evaluator, now)
    close_stalled_votes(db, storage, r, evaluator, now)
    duplicates.release_orphaned_workunits(db, WORKUNIT_MODES)
    close_finished_epochs(db, storage, r, evaluator)
    reopen_abandoned_merges(db, r)
    export_pending_models(db, storage, r)
    experts.expire_leases(db, now.replace(tzinfo=UTC).timestamp())
    if stalled is not None:
        stalled_after, enqueue = stalled
        requeue_stalled_merges(db, stalled_after, enqueue, now)
        end_stalled_uploads(db, r, stalled_after, enqueue, now)


def run_forever(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    evaluator: Evaluator,
    interval: float,
    stalled_after: float,
    enqueue: Callable[[int, Stamps], None],
    stop: threading.Event,
) -> None:
    """`sweep` every `interval` seconds at the clock's time until `stop`; the stalled merges every
    `stalled_after` seconds."""
    last_requeue = 0.0
    while not stop.is_set():
        try:
            requeue = time.monotonic() - last_requeue >= stalled_after
            sweep(db, storage, r, evaluator, utcnow(), (stalled_after, enqueue) if requeue else None)
            if requeue:
                last_requeue = time.monotonic()
        except Exception:
            log.exception("transitioner sweep failed; retrying in %ss", interval)
        stop.wait(interval)
