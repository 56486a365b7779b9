"""Epochs of a job's workunits: releasing them, and closing them with the stop rule, which may end the
job (crowdtrain.server.ledger.job_end) with its final model exported."""

import logging
from collections.abc import Iterable

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys
from crowdtrain.core.jobspec import WORKUNIT_MODES
from crowdtrain.core.logs import ids
from crowdtrain.core.states import JobStatus, WorkunitStatus
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger.exports import export_or_leave_it
from crowdtrain.server.ledger.job_end import (
    OPEN,
    TRIES,
    Evaluator,
    ExportBelowTarget,
    ScoreFirst,
    Scores,
    accuracy_of,
    ending,
    finish,
    lock_job,
    score_server_model,
)
from crowdtrain.server.ledger.models import Job, Metric, Shard, Workunit
from crowdtrain.server.paramstore import store

log = logging.getLogger(__name__)


def epoch_accuracy(s: Session, job_id: int, epoch: int) -> float | None:
    """An epoch's figure: the mean validation accuracy over its merges."""
    return s.scalar(select(func.avg(Metric.val_accuracy)).where(Metric.job_id == job_id, Metric.epoch == epoch))


def _open_workunits(s: Session, job_id: int, epoch: int) -> int:
    return s.execute(
        select(func.count())
        .select_from(Workunit)
        .where(Workunit.job_id == job_id, Workunit.epoch == epoch, Workunit.status.in_(OPEN))
    ).scalar_one()


def release_epoch(s: Session, job: Job, epoch: int) -> bool:
    """Create one ready workunit per shard for `epoch` in the transaction `s`; idempotent (False if
    already released).

    A job that re-deals its examples each epoch (`dataset.reshuffle_each_epoch`) gets shard rows of
    its own for every epoch from 2 on (epoch 1 uses the deal made at submission), with no bytes yet:
    the work generator writes them when one is first dispatched
    (crowdtrain.workgen.generator.write_epoch_shards), not here, in the job's locked transaction.

    Only VC-ASGD and moe jobs have workunits: releasing an epoch of another mode raises ValueError, so that
    no path (dispatch, epoch closing, a repair) can hand a DeDLOC job's shards out as VC-ASGD work.
    """
    if job.mode not in WORKUNIT_MODES:
        raise ValueError(f"job {job.id} runs in mode {job.mode!r}: only {WORKUNIT_MODES} jobs have epochs of workunits")
    if job.current_epoch >= epoch:
        return False
    shard_ids = s.scalars(select(Shard.id).where(Shard.job_id == job.id, Shard.epoch == 0).order_by(Shard.index)).all()
    if epoch >= 2 and job.spec["dataset"].get("reshuffle_each_epoch"):
        own = [
            Shard(
                job_id=job.id,
                epoch=epoch,
                index=i,
                key=keys.shard_key(job.id, epoch, i),
                sha256=None,
                size=0,
                examples=0,
            )
            for i in range(len(shard_ids))
        ]
        s.add_all(own)
        s.flush()
        shard_ids = [sh.id for sh in own]
    s.add_all(
        Workunit(job_id=job.id, epoch=epoch, shard_id=sid, status=WorkunitStatus.ready.value) for sid in shard_ids
    )
    job.current_epoch = epoch
    log.info("job %s: epoch %d released (%d workunits)", job.id, epoch, len(shard_ids))
    return True


def next_epoch_releasable(s: Session, job: Job, ignore_ready: bool = False) -> bool:
    """Early release: the current epoch has nothing left to dispatch and no older epoch is still open.

    `ignore_ready` is for a caller that has already seen every ready workunit claimed by others.
    Never for a job of a mode without workunits (see `release_epoch`). Read only.
    """
    if job.mode not in WORKUNIT_MODES:
        return False
    if job.status != JobStatus.running.value or job.current_epoch >= job.spec["stop"]["max_epochs"]:
        return False
    ready = (
        0
        if ignore_ready
        else s.scalar(
            select(func.count())
            .select_from(Workunit)
            .where(
                Workunit.job_id == job.id,
                Workunit.epoch == job.current_epoch,
                Workunit.status == WorkunitStatus.ready.value,
            )
        )
    )
    older_open = s.scalar(
        select(func.count())
        .select_from(Workunit)
        .where(Workunit.job_id == job.id, Workunit.epoch < job.current_epoch, Workunit.status.in_(OPEN))
    )
    return ready == 0 and older_open == 0


def release_next_epoch_early(s: Session, job: Job) -> bool:
    """For a dispatcher that found nothing ready to claim: release the next epoch in `s` if the
    current one has nothing left to dispatch (`next_epoch_releasable`).

    True when a newer epoch is now available to claim from, whoever released it. Takes the job's row
    lock only when a release looks possible, so idle hosts asking for work do not queue on it.
    """
    seen_epoch = job.current_epoch
    if not next_epoch_releasable(s, job, ignore_ready=True):
        s.refresh(job)
        return job.current_epoch > seen_epoch
    # Serialise on the job row so that two schedulers cannot both release the same epoch.
    s.execute(select(Job.id).where(Job.id == job.id).with_for_update())
    s.refresh(job)
    if job.current_epoch > seen_epoch:
        return True
    # Ready rows locked by other claims in flight are as good as taken; an unlocked one is claimable.
    unlocked_ready = s.scalar(
        select(Workunit.id)
        .where(
            Workunit.job_id == job.id,
            Workunit.epoch == job.current_epoch,
            Workunit.status == WorkunitStatus.ready.value,
        )
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    if unlocked_ready is not None:
        return True
    if not next_epoch_releasable(s, job, ignore_ready=True):
        return False
    release_epoch(s, job, job.current_epoch + 1)
    s.flush()
    return True


def close_epoch_if_complete(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int, epoch: int, evaluator: Evaluator
) -> None:
    """If every workunit of `epoch` is done or failed, apply the stop rule: the job succeeds (target
    accuracy reached by the epoch's mean and by the model it exports) or fails (max_epochs reached),
    its model exported (`evaluator` scores it when no metric of that version is recorded, outside any
    transaction: ScoreFirst); else the next epoch is released. Safe to call repeatedly. One
    transaction (again, at most `TRIES` times in all, when W_s had to be scored first or changed
    below the target between the check and the export; the transitioner's sweep calls it again).

    The stop rule reads epochs in order. An epoch released early can close before an older one; it
    then waits, and the older epoch's closing applies the rule to it as well, so that no job ends
    while an older epoch still has work running (which would be cancelled and its examples lost).
    """
    # Most calls find the epoch still open: answer those without queueing on the job row's lock.
    with db.begin() as s:
        if _open_workunits(s, job_id, epoch):
            return
    scores: Scores = {}
    for _ in range(TRIES):
        try:
            if _close_epoch(db, r, job_id, epoch, scores):
                export_or_leave_it(db, storage, r, job_id)
            return
        except ScoreFirst:
            scores.update(score_server_model(db, storage, r, job_id, evaluator))
        except ExportBelowTarget as exc:
            log.info("job %s: %s; the stop rule is applied again", job_id, exc, extra=ids(job_id=job_id, epoch=epoch))


def _close_epoch(db: sessionmaker[Session], r: redis.Redis, job_id: int, epoch: int, scores: Scores) -> bool:
    """`close_epoch_if_complete`'s transaction: True when it ended the job (its model still to export);
    ScoreFirst when the stop rule needs a version of W_s that `scores` lacks."""
    with ending(db, r) as s:
        job = lock_job(s, job_id)
        if job.status != JobStatus.running.value or _open_workunits(s, job_id, epoch):
            return False
        if _open_before(s, job_id, epoch):
            log.info(
                "job %s: epoch %d closed before an older one; the stop rule waits for it",
                job_id,
                epoch,
                extra=ids(job_id=job_id, epoch=epoch),
            )
            return False
        closed = epoch
        while not _apply_stop_rule(s, r, job, closed, scores):
            if closed >= job.current_epoch:
                release_epoch(s, job, job.current_epoch + 1)
                return False
            closed += 1
            if _open_workunits(s, job_id, closed):
                if next_epoch_releasable(s, job):
                    release_epoch(s, job, job.current_epoch + 1)
                return False
        return True


def _open_before(s: Session, job_id: int, epoch: int) -> int:
    return s.execute(
        select(func.count())
        .select_from(Workunit)
        .where(Workunit.job_id == job_id, Workunit.epoch < epoch, Workunit.status.in_(OPEN))
    ).scalar_one()


def _apply_stop_rule(s: Session, r: redis.Redis, job: Job, epoch: int, scores: Scores) -> bool:
    """The stop rule for a closed `epoch` whose older epochs are all closed: True if it ended the job."""
    figure = epoch_accuracy(s, job.id, epoch)
    stop = job.spec["stop"]
    shown = "n/a" if figure is None else f"{figure:.4f}"
    target = stop["target_accuracy"]
    if figure is not None and figure >= target:
        # The job succeeds only if the model it exports meets the target, not an epoch's mean of it.
        version = store.version_of(r, job.id)
        exported = accuracy_of(s, job, version, scores)
        if exported is not None and exported >= target:
            message = (
                f"epoch {epoch} reached mean validation accuracy {figure:.4f} and W_s v{version} {exported:.4f} "
                f">= {target}"
            )
            scored = (version, exported)
            finish(s, r, job, JobStatus.succeeded, scores, message, require=target, scored=scored)
            return True
        log.info(
            "job %s: epoch %d's mean validation accuracy %.4f reached the target %s, but W_s v%d scores %s: "
            "training goes on",
            job.id,
            epoch,
            figure,
            target,
            version,
            "n/a" if exported is None else f"{exported:.4f}",
            extra=ids(job_id=job.id, epoch=epoch),
        )
    if epoch >= stop["max_epochs"]:
        message = (
            f"max_epochs={stop['max_epochs']} reached; last epoch accuracy {shown} < target {stop['target_accuracy']}"
        )
        finish(s, r, job, JobStatus.failed, scores, message)
        return True
    log.info(
        "job %s: epoch %d closed with accuracy %s (target %s)",
        job.id,
        epoch,
        shown,
        stop["target_accuracy"],
        extra=ids(job_id=job.id, epoch=epoch),
    )
    return False


def close_epochs_after_failure(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, failed: Iterable[tuple[int, int]], evaluator: Evaluator
) -> None:
    """The one way to go on after assignments ended and some workunits failed for good (max_errors):
    close each distinct epoch (job id, epoch) of `failed`, as `close_epoch_if_complete` does, once
    the transaction that ended them has committed. An empty `failed` does nothing."""
    for job_id, epoch in sorted(set(failed)):
        close_epoch_if_complete(db, storage, r, job_id, epoch, evaluator)
