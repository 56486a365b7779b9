"""A job's end: the decision recorded in one short transaction, with nothing slow inside it.

The end locks the job row (on SQLite, the whole database's write lock), closes its merges, records its
outcome, cancels its open workunits and records the validation accuracy of exactly the version of W_s
it exports: that version's metric, or a score taken outside any transaction (ScoreFirst: the
transaction rolls back, `score_server_model` evaluates W_s, and the end is tried again). The export
itself is written after the commit (crowdtrain.server.ledger.exports). crowdtrain.server.ledger.epochs
applies the stop rule that decides a job's end; `fail_job` ends one for other causes."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.jobspec import WORKUNIT_MODES
from crowdtrain.core.logs import ids
from crowdtrain.core.states import JobStatus, WorkunitStatus
from crowdtrain.core.storage import Storage
from crowdtrain.core.tensors import Params, decode, decode_shard
from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.exports import export_or_leave_it
from crowdtrain.server.ledger.models import Job, Metric, Workunit, utcnow
from crowdtrain.server.paramstore import store

log = logging.getLogger(__name__)

OPEN = [WorkunitStatus.ready.value, WorkunitStatus.in_progress.value]  # a workunit not ended yet


class Evaluator(Protocol):
    """Scores parameters on a validation split. Each process makes one where it starts
    (crowdtrain.assimilator.evaluate.FrameworkEvaluator) and its services hand it to the ledger, which
    only calls what it is given: to score the model a job exports when no metric of it is recorded."""

    def evaluate(
        self, job_id: int, model_config: dict, params: Params, x: np.ndarray, y: np.ndarray
    ) -> tuple[float, float]:
        """(mean loss, accuracy) of `params` on (x, y)."""
        ...


def lock_job(s: Session, job_id: int) -> Job:
    """The job's row, locked for the rest of the transaction `s`."""
    return s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()


class ExportBelowTarget(Exception):
    """W_s changed between the stop rule's check and the export, and the exported version misses the
    target: the transaction ending the job rolls back (its merges reopen) and the rule is applied again."""


class ScoreFirst(Exception):
    """The job's end needs the validation accuracy of W_s `version`, which no metric records and which
    is not scored yet: the transaction rolls back (its merges reopen), W_s is scored outside it
    (`score_server_model`), and the end is tried again. An evaluation takes seconds; the job row's
    lock (on SQLite, the whole database's write lock) is never held for it."""

    def __init__(self, version: int):
        super().__init__(f"W_s v{version} is to be scored before the job ends")
        self.version = version


# Accuracies of W_s's versions scored outside the transactions that end a job (None: not evaluable).
Scores = dict[int, float | None]

TRIES = 5  # attempts at a job's end in one call; a sweep of the transitioner tries again after that


def fail_job(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int, message: str, evaluator: Evaluator
) -> bool:
    """End a running job as failed with `message`, its model exported as it stands (scored by
    `evaluator`, outside the transaction, when no metric of that version is recorded); False if it was
    no longer running. One transaction (again, if W_s had to be scored first), then the export
    (`export_final_model`)."""
    scores: Scores = {}
    for attempt in range(1, TRIES + 1):
        try:
            with ending(db, r) as s:
                job = lock_job(s, job_id)
                if job.status != JobStatus.running.value:
                    return False
                # the last try ends the job with its final accuracy unknown if W_s kept moving while it was scored
                finish(s, r, job, JobStatus.failed, scores, message, unscored=attempt == TRIES)
            break
        except ScoreFirst:
            scores.update(score_server_model(db, storage, r, job_id, evaluator))
    export_or_leave_it(db, storage, r, job_id)
    return True


def finish(
    s: Session,
    r: redis.Redis,
    job: Job,
    outcome: JobStatus,
    scores: Scores,
    message: str,
    require: float | None = None,
    scored: tuple[int, float] | None = None,
    unscored: bool = False,
) -> None:
    """Close the job's merges and record its end, with the validation accuracy of exactly the version
    it exports; the export itself is written after the transaction commits (`export_final_model`), so
    that no object storage write holds the job's lock (on SQLite, the whole database's). `s` is an
    `ending` transaction: if it does not commit, the job still runs and its merges reopen.

    The exported version's accuracy is its recorded metric, else its score in `scores`, else ScoreFirst
    rolls the transaction back to have it scored (with `unscored`, it is recorded as unknown instead).
    With `require`, a version scoring below it raises ExportBelowTarget before anything is recorded.
    `scored` (version, accuracy) is a version the caller has just scored: not scored again if it is
    still the one exported."""
    close_merges(s, r, job.id)
    version = store.version_of(r, job.id)
    if scored is not None and scored[0] == version:
        job.final_accuracy = scored[1]
    else:
        try:
            job.final_accuracy = accuracy_of(s, job, version, scores)
        except ScoreFirst:
            if not unscored:
                raise
            job.final_accuracy = None
    if require is not None and (job.final_accuracy is None or job.final_accuracy < require):
        raise ExportBelowTarget(f"W_s v{version}, to be exported, scores {job.final_accuracy} < {require}")
    job.param_version = max(job.param_version, version)
    cancel_open_workunits(s, job.id)
    states.move(job, outcome)
    job.status_message = message
    job.finished_at = utcnow()
    log.info("job %s %s: %s; final model v%d to export", job.id, outcome.value, message, version)


_CLOSED = "crowdtrain.closed_merges"  # Session.info: the jobs whose merges the transaction closed


@contextmanager
def ending(db: sessionmaker[Session], r: redis.Redis) -> Iterator[Session]:
    """A transaction that may close jobs' merges (`close_merges`), compensated by state rather than by
    session events: if it does not commit, each job it closed gets its merges back while it still runs
    (`reopen_if_running`); once it commits, what only running merges read is deleted
    (store.forget_finished). A process that dies in between leaves a running job's merges closed:
    the transitioner's sweep reopens them (`reopen_abandoned_merges`)."""
    closed: set[int] = set()
    try:
        with db.begin() as s:
            s.info[_CLOSED] = closed
            yield s
    except BaseException:
        for job_id in sorted(closed):
            reopen_if_running(db, r, job_id)
        raise
    for job_id in sorted(closed):
        store.forget_finished(r, job_id)


def close_merges(s: Session, r: redis.Redis, job_id: int) -> set[int]:
    """Close the job's merges (store.close_merges) as part of the `ending` transaction `s`, which holds
    the job row's lock: reopened if `s` does not commit, final once it does. Returns the assignment ids
    W_s holds."""
    if _CLOSED not in s.info:
        raise RuntimeError("close_merges belongs in an `ending` transaction, which reopens them if it fails")
    s.info[_CLOSED].add(job_id)
    return store.close_merges(r, job_id)


def reopen_if_running(db: sessionmaker[Session], r: redis.Redis, job_id: int) -> bool:
    """Reopen the job's merges if they are closed while it runs; whether it did. Under the job row's
    lock, which every transaction that closes merges holds until it commits or rolls back, so merges
    closed now belong to a job's end that did not commit: never to one in progress."""
    if not store.merges_closed(r, job_id):
        return False
    with db.begin() as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
        if job is None or job.status != JobStatus.running.value or not store.merges_closed(r, job_id):
            return False
        store.reopen_merges(r, job_id)
    log.warning("job %s: its merges were closed by an end that never committed; reopened", job_id)
    return True


def reopen_abandoned_merges(db: sessionmaker[Session], r: redis.Redis) -> int:
    """`reopen_if_running` for every running job of the workunit modes (the transitioner's sweep: a
    process that died inside a job's end left its merges closed); how many it reopened."""
    with db.begin() as s:
        running = s.scalars(
            select(Job.id).where(Job.status == JobStatus.running.value, Job.mode.in_(WORKUNIT_MODES))
        ).all()
    return sum(reopen_if_running(db, r, job_id) for job_id in running)


def accuracy_of(s: Session, job: Job, version: int, scores: Scores) -> float | None:
    """Validation accuracy of W_s `version`: its recorded metric, else its score in `scores` (None:
    it could not be evaluated); ScoreFirst when it has neither.

    A merge may land after the last recorded metric (or eval_every may skip versions), so the
    newest metric is not necessarily the exported model's.
    """
    recorded = s.scalar(
        select(Metric.val_accuracy)
        .where(Metric.job_id == job.id, Metric.param_version == version)
        .order_by(Metric.id.desc())
        .limit(1)
    )
    if recorded is not None:
        return recorded
    if version in scores:
        return scores[version]
    raise ScoreFirst(version)


def score_server_model(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int, evaluator: Evaluator
) -> Scores:
    """W_s's version now and its validation accuracy (None, logged, when it cannot be evaluated), with no
    transaction open: what a job's end that raised ScoreFirst needs. W_s may have moved past the
    version the end asked for; the end then asks again."""
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        model_config, validation_key = job.model_config_, job.validation_key
    version, blob = store.read_blob(r, job_id)
    try:
        x, y = decode_shard(storage.get(validation_key))
        return {version: evaluator.evaluate(job_id, model_config, decode(blob), x, y)[1]}
    except Exception as exc:  # the job ends either way; a missing figure is logged, not fatal
        log.warning(
            "job %s: the exported W_s v%d could not be evaluated: %s: %s",
            job_id,
            version,
            type(exc).__name__,
            exc,
            extra=ids(job_id=job_id),
        )
        return {version: None}


def cancel_open_workunits(s: Session, job_id: int) -> int:
    """Cancel the job's ready and in-progress workunits in `s` (its end); returns how many."""
    wus = s.scalars(select(Workunit).where(Workunit.job_id == job_id, Workunit.status.in_(OPEN))).all()
    for wu in wus:
        states.move(wu, WorkunitStatus.cancelled)
        wu.finished_at = utcnow()
    return len(wus)
