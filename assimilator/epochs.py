"""Closing epochs: the stop rule, the next epoch, and the final model export."""

import logging

import redis
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, sessionmaker

from assimilator import paramstore
from assimilator.evaluate import evaluate
from crowdtrain.logs import ids
from crowdtrain.storage import Storage
from crowdtrain.tensors import decode, decode_shard
from server import states
from server.models import Job, Metric, Workunit, utcnow
from server.states import JobStatus, WorkunitStatus
from workgen.generator import next_epoch_releasable, release_epoch

log = logging.getLogger(__name__)


def final_key(job_id: int) -> str:
    return f"jobs/{job_id}/final.safetensors"


def _lock_job(s: Session, job_id: int) -> Job:
    return s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()


def epoch_accuracy(s: Session, job_id: int, epoch: int) -> float | None:
    """An epoch's figure: the mean validation accuracy over its merges."""
    return s.scalar(select(func.avg(Metric.val_accuracy)).where(Metric.job_id == job_id, Metric.epoch == epoch))


def _open_workunits(s: Session, job_id: int, epoch: int) -> int:
    return s.scalar(select(func.count()).select_from(Workunit).where(
        Workunit.job_id == job_id, Workunit.epoch == epoch,
        Workunit.status.in_([WorkunitStatus.ready.value, WorkunitStatus.in_progress.value])))


def close_epoch_if_complete(db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int,
                            epoch: int) -> None:
    """If every workunit of `epoch` is done or failed, apply the stop rule; safe to call repeatedly."""
    # Most calls find the epoch still open: answer those without queueing on the job row's lock.
    with db.begin() as s:
        if _open_workunits(s, job_id, epoch):
            return
    with db.begin() as s:
        job = _lock_job(s, job_id)
        if job.status != JobStatus.running.value or _open_workunits(s, job_id, epoch):
            return
        figure = epoch_accuracy(s, job_id, epoch)
        stop = job.spec["stop"]
        shown = "n/a" if figure is None else f"{figure:.4f}"
        if figure is not None and figure >= stop["target_accuracy"]:
            _finish(s, storage, r, job, JobStatus.succeeded,
                    f"epoch {epoch} reached mean validation accuracy {figure:.4f} >= {stop['target_accuracy']}")
        elif epoch >= stop["max_epochs"]:
            _finish(s, storage, r, job, JobStatus.failed,
                    f"max_epochs={stop['max_epochs']} reached; last epoch accuracy {shown} "
                    f"< target {stop['target_accuracy']}")
        else:
            log.info("job %s: epoch %d closed with accuracy %s (target %s)", job_id, epoch, shown,
                     stop["target_accuracy"], extra=ids(job_id=job_id, epoch=epoch))
            if epoch == job.current_epoch or next_epoch_releasable(s, job):
                release_epoch(s, job, job.current_epoch + 1)


def fail_job(db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int, message: str) -> bool:
    """End a running job as failed with `message` (its model is exported as it stands); False if it
    was no longer running."""
    with db.begin() as s:
        job = _lock_job(s, job_id)
        if job.status != JobStatus.running.value:
            return False
        _finish(s, storage, r, job, JobStatus.failed, message)
        return True


def _finish(s: Session, storage: Storage, r: redis.Redis, job: Job, outcome: JobStatus, message: str) -> None:
    """Close the job's merges, export W_s and report the validation accuracy of exactly the version
    exported. If the transaction does not commit, the job still runs and its merges reopen."""
    close_merges(s, r, job.id)
    version, blob = paramstore.read_blob(r, job.id)
    storage.put(final_key(job.id), blob)
    job.final_key = final_key(job.id)
    job.param_version = max(job.param_version, version)
    job.final_accuracy = _accuracy_of(s, storage, job, version, blob)
    cancel_open_workunits(s, job.id)
    states.move(job, outcome)
    job.status_message = message
    job.finished_at = utcnow()
    log.info("job %s %s: %s; final model v%d exported to %s", job.id, outcome.value, message, version, job.final_key)


def close_merges(s: Session, r: redis.Redis, job_id: int) -> set[int]:
    """Close the job's merges (paramstore.close_merges) as part of the transaction `s` that ends it:
    reopened if `s` rolls back. Returns the assignment ids W_s holds, final once `s` commits."""
    event.listen(s, "after_rollback", lambda _: paramstore.reopen_merges(r, job_id), once=True)
    return paramstore.close_merges(r, job_id)


def _accuracy_of(s: Session, storage: Storage, job: Job, version: int, blob: bytes) -> float | None:
    """Validation accuracy of W_s `version` (`blob`): its recorded metric, else evaluated now.

    A merge may land after the last recorded metric (or eval_every may skip versions), so the
    newest metric is not necessarily the exported model's. None if it cannot be evaluated.
    """
    recorded = s.scalar(select(Metric.val_accuracy).where(Metric.job_id == job.id, Metric.param_version == version)
                        .limit(1))
    if recorded is not None:
        return recorded
    try:
        x, y = decode_shard(storage.get(job.validation_key))
        return evaluate(job.id, job.model_config_, decode(blob), x, y)[1]
    except Exception as exc:  # the job ends either way; a missing figure is logged, not fatal
        log.warning("job %s: the exported W_s v%d could not be evaluated: %s: %s", job.id, version,
                    type(exc).__name__, exc, extra=ids(job_id=job.id))
        return None


def cancel_open_workunits(s: Session, job_id: int) -> int:
    wus = s.scalars(select(Workunit).where(
        Workunit.job_id == job_id,
        Workunit.status.in_([WorkunitStatus.ready.value, WorkunitStatus.in_progress.value]))).all()
    for wu in wus:
        states.move(wu, WorkunitStatus.cancelled)
        wu.finished_at = utcnow()
    return len(wus)
