"""The ledger's side of a parameter server's merge: the result waiting to be merged, and each outcome.

A merge task is delivered at least once (late acks, redelivery when a worker dies), while W_s
takes each result exactly once (merging.merge_batch). So every procedure here is idempotent:
run twice for the same assignment, it records the outcome once. The outcomes:
- merged: the assignment is `merged` at the W_s version that holds it, its workunit done, its host
  counted valid and given the result's credit (crowdtrain.core.credit) (`record_merge`), and a
  validation metric per merge when due (`record_metric`);
- rejected: the assignment ends `rejected`, charged to its workunit and host or not, and the
  workunit is ready again or, at `max_errors`, failed (`reject_result`);
- failed on the server: a merge that retrying cannot mend ends its assignment, and fails the job
  when the cause is the job's own or when merges keep failing (`end_failed_merge`).
"""

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.logs import ids
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger import replicas, reputation, states
from crowdtrain.server.ledger.assignments import end_assignment
from crowdtrain.server.ledger.duplicates import lock_siblings, supersede_siblings
from crowdtrain.server.ledger.epochs import close_epochs_after_failure
from crowdtrain.server.ledger.job_end import Evaluator, fail_job
from crowdtrain.server.ledger.models import Assignment, Host, Job, Metric, Workunit, utcnow
from crowdtrain.server.ledger.pace import measure_pace
from crowdtrain.server.paramstore import merging, store

log = logging.getLogger(__name__)

MERGE_FAILURES_BEFORE_JOB_FAILS = 3

Row = TypeVar("Row", Host, Workunit)


@dataclass(frozen=True)
class PendingMerge:
    """An uploaded result as the ledger knows it when its merge task starts."""

    assignment_id: int
    job_id: int
    epoch: int
    base_version: int  # the W_s snapshot the host started from
    upload_key: str
    spec: dict  # the job's spec (a JobSpec as a dict)
    manifest: dict  # the model's tensors: name -> (shape, dtype)
    model_config: dict
    workunit_id: int
    job_running: bool
    workunit_open: bool  # no other assignment finished the workunit
    workunit_done: bool  # another assignment of the workunit (a straggler's duplicate) was merged
    already_merged: bool  # the ledger recorded the merge (a redelivered task)
    quorum: int = 1  # replicas compared before one is merged (ledger.replicas)
    canonical: int | None = None  # the replica the validator chose, once it has judged them


def pending_merge(db: sessionmaker[Session], assignment_id: int) -> PendingMerge | None:
    """The result of `assignment_id` when it is uploaded (or already merged); None when the assignment
    is unknown or has ended otherwise, so that there is nothing to merge."""
    return pending_merges(db, [assignment_id])[assignment_id]


def pending_merges(db: sessionmaker[Session], assignment_ids: Sequence[int]) -> dict[int, PendingMerge | None]:
    """`pending_merge` of each of `assignment_ids`, read in one transaction (a merge pass's)."""
    with db.begin() as s:
        return {assignment_id: _pending(s, assignment_id) for assignment_id in assignment_ids}


def _pending(s: Session, assignment_id: int) -> PendingMerge | None:
    a = s.get(Assignment, assignment_id)
    if a is None or a.status not in (AssignmentStatus.uploaded.value, AssignmentStatus.merged.value):
        log.info("assignment %s: nothing to merge (%s)", assignment_id, "unknown" if a is None else a.status)
        return None
    job = s.get_one(Job, a.job_id)
    wu = s.get_one(Workunit, a.workunit_id)
    assert a.upload_key is not None  # set with the status uploaded (crowdtrain.server.services.results.store_result)
    return PendingMerge(
        assignment_id=a.id,
        job_id=job.id,
        epoch=wu.epoch,
        base_version=a.base_version,
        upload_key=a.upload_key,
        spec=job.spec,
        manifest=job.param_manifest,
        model_config=job.model_config_,
        workunit_id=wu.id,
        job_running=job.status == JobStatus.running.value,
        workunit_open=wu.status == WorkunitStatus.in_progress.value,
        workunit_done=wu.status == WorkunitStatus.done.value,
        already_merged=a.status == AssignmentStatus.merged.value,
        quorum=wu.quorum,
        canonical=wu.canonical_assignment_id,
    )


def ready_to_merge(db: sessionmaker[Session], job_id: int, limit: int) -> list[tuple[PendingMerge, float]]:
    """The job's uploaded results that a merge pass takes, oldest upload first, at most `limit`: each
    one's `pending_merge`, read in the same transaction, with its upload time (seconds since the
    epoch). Replicated workunits' results are left out: each goes through its replicas' vote on its
    own (crowdtrain.assimilator.merge)."""
    with db.begin() as s:
        rows = s.execute(
            select(Assignment.id, Assignment.uploaded_at)
            .join(Workunit, Workunit.id == Assignment.workunit_id)
            .where(
                Assignment.job_id == job_id,
                Assignment.status == AssignmentStatus.uploaded.value,
                Workunit.quorum == 1,
            )
            .order_by(Assignment.uploaded_at, Assignment.id)
            .limit(limit)
        ).all()
        ready = [(_pending(s, aid), (at or utcnow()).replace(tzinfo=UTC).timestamp()) for aid, at in rows]
    return [(pending, at) for pending, at in ready if pending is not None]  # all are: uploaded, in this transaction


def record_merge(db: sessionmaker[Session], assignment_id: int, version: int, now: datetime | None = None) -> list[str]:
    """The result is in W_s `version` (at `now`, the present by default): the assignment is merged,
    its workunit done, its host credited, a duplicate of it still live ends `superseded`
    (ledger.duplicates), and the job's merge pace is measured anew (ledger.pace). Returns the upload
    keys of superseded results, for the caller to delete.

    Does nothing when already recorded; an assignment ended meanwhile (its job was cancelled or
    finished) stays ended, with a warning: W_s holds it, the ledger cannot say so any more. One
    `rejected` meanwhile is recorded merged all the same: another process ended it (its own merge
    failed on the server, or refused it) while this pass wrote it into W_s, which the ledger must
    then say, or its workunit would be dealt again and every later result of it superseded by
    this one (crowdtrain.server.ledger.duplicates), without end.
    """
    return record_merges(db, [(assignment_id, version)], now)


def record_merges(
    db: sessionmaker[Session], merged: Sequence[tuple[int, int]], now: datetime | None = None
) -> list[str]:
    """`record_merge` of each (assignment id, W_s version) of one job, in one transaction (a merge
    pass's); the upload keys of the results they superseded."""
    finished_at = now or utcnow()
    versions = dict(merged)
    with db.begin() as s:
        # Lock order assignment -> host -> workunit -> job (see ledger/assignments.py), each kind by id.
        locked = s.scalars(
            select(Assignment).where(Assignment.id.in_(versions)).order_by(Assignment.id).with_for_update()
        ).all()
        recording = [a for a in locked if _to_record(a, versions[a.id])]
        if not recording:
            return []
        siblings = {a.id: lock_siblings(s, a) for a in recording}
        hosts = _locked(s, Host, {a.host_id for a in recording})
        workunits = _locked(s, Workunit, {a.workunit_id for a in recording})
        job_ids = {a.job_id for a in recording}
        assert len(job_ids) == 1, "a merge pass records one job's results"
        job = s.scalars(select(Job).where(Job.id.in_(job_ids)).with_for_update()).one()
        superseded_uploads = []
        for a in sorted(recording, key=lambda a: versions[a.id]):
            if a.status == AssignmentStatus.rejected.value:
                a.message = f"merged into W_s v{versions[a.id]} after it was rejected ({a.message})"[:1000]
            states.move(a, AssignmentStatus.merged)
            a.merged_version, a.finished_at = versions[a.id], finished_at
            host, wu = hosts[a.host_id], workunits[a.workunit_id]
            if wu.status in (WorkunitStatus.in_progress.value, WorkunitStatus.ready.value):
                states.move(wu, WorkunitStatus.done)  # ready: released when `a` was rejected (_to_record)
                wu.finished_at = finished_at
            job.param_version = max(job.param_version, versions[a.id])
            reputation.count_valid(host, (finished_at - a.sent_at).total_seconds())
            replicas.grant_credit(s, a, host, job, wu)
            superseded_uploads += supersede_siblings(s, a, siblings[a.id])
        measure_pace(s, job)
        logged = [(a.id, versions[a.id], a.job_id, a.workunit_id) for a in recording]
    for assignment_id, version, job_id, workunit_id in logged:
        log.info(
            "assignment %s: merged into W_s v%d",
            assignment_id,
            version,
            extra=ids(job_id=job_id, workunit_id=workunit_id, assignment_id=assignment_id),
        )
    return superseded_uploads


def _to_record(a: Assignment, version: int) -> bool:
    """Whether the merge of `a` into W_s `version` is still to record: uploaded, or rejected while it
    was merged (record_merges says why; it keeps the rejection in the message); warned when it ended
    otherwise meanwhile. Reads only."""
    if a.status == AssignmentStatus.uploaded.value:
        return True
    if a.status == AssignmentStatus.merged.value:
        return False
    rejected = a.status == AssignmentStatus.rejected.value
    log.warning(
        "assignment %s: merged into W_s v%d after it was ended (%s)%s",
        a.id,
        version,
        a.status,
        "; recorded merged, as W_s holds it" if rejected else "",
        extra=ids(job_id=a.job_id, assignment_id=a.id),
    )
    return rejected


def is_rejected(db: sessionmaker[Session], assignment_id: int) -> bool:
    """Whether the assignment ended `rejected` (record_merges records it merged all the same when W_s holds it)."""
    with db.begin() as s:
        status = s.scalar(select(Assignment.status).where(Assignment.id == assignment_id))
    return status == AssignmentStatus.rejected.value


def _locked(s: Session, model: type[Row], row_ids: set[int]) -> dict[int, Row]:
    """The rows of `model` with `row_ids`, locked in id order."""
    rows = s.scalars(select(model).where(model.id.in_(row_ids)).order_by(model.id).with_for_update()).all()
    return {row.id: row for row in rows}


def reject_result(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    assignment_id: int,
    message: str,
    charge: bool,
    evaluator: Evaluator,
) -> bool:
    """Refuse an uploaded result: the assignment ends `rejected` with `message`, its upload is deleted,
    and its workunit is ready again, or failed when `charge` brings it to `max_errors` (closing the
    epoch when that was its last open workunit). False, and nothing done, when the assignment is no
    longer uploaded (a redelivered task)."""
    with db.begin() as s:
        a = s.get_one(Assignment, assignment_id, with_for_update=True)
        if a.status != AssignmentStatus.uploaded.value:
            return False
        wu = end_assignment(s, a, AssignmentStatus.rejected, message, charge=charge)
        job_id, epoch, failed = a.job_id, wu.epoch, wu.status == WorkunitStatus.failed.value
        upload_key = a.upload_key
    if upload_key:
        storage.delete(upload_key)
    log.warning(
        "assignment %s: rejected, %s",
        assignment_id,
        message,
        extra=ids(job_id=job_id, epoch=epoch, assignment_id=assignment_id),
    )
    close_epochs_after_failure(db, storage, r, [(job_id, epoch)] if failed else [], evaluator)
    return True


def end_failed_merge(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    assignment_id: int,
    cause: str,
    job_broken: bool,
    evaluator: Evaluator,
) -> bool:
    """A merge failed for a reason that retrying will not remove: end the assignment, uncharged, so
    that nothing queues it again (or record it merged, when W_s holds it after all), and fail the
    job when the cause is the job's own (`job_broken`) or when MERGE_FAILURES_BEFORE_JOB_FAILS merges
    in a row have failed. True when the result was rejected."""
    with db.begin() as s:
        a = s.get(Assignment, assignment_id)
        job_id = None if a is None else a.job_id
    if job_id is None:
        return False
    rejected = False
    version = merging.merged_version(r, job_id, assignment_id)
    if version is not None:
        for key in record_merge(db, assignment_id, version):
            storage.delete(key)
    else:
        rejected = reject_result(
            db, storage, r, assignment_id, f"merge failed on the server: {cause}", charge=False, evaluator=evaluator
        )
    if job_broken:
        fail_job(db, storage, r, job_id, cause, evaluator)
    elif (failures := store.count_merge_failure(r, job_id)) >= MERGE_FAILURES_BEFORE_JOB_FAILS:
        fail_job(
            db, storage, r, job_id, f"{failures} merges in a row failed on the server; the last: {cause}", evaluator
        )
    return rejected


def unmeasured_validation_key(db: sessionmaker[Session], job_id: int, assignment_id: int) -> str | None:
    """The job's validation set, when the merge of `assignment_id` has no metric yet; else None."""
    with db.begin() as s:
        if s.scalar(select(Metric.id).where(Metric.assignment_id == assignment_id)) is not None:
            return None
        return s.get_one(Job, job_id).validation_key


def record_metric(
    db: sessionmaker[Session], job_id: int, epoch: int, assignment_id: int, version: int, loss: float, accuracy: float
) -> None:
    """The validation figure of W_s `version`, right after the merge of `assignment_id` (once)."""
    with db.begin() as s:
        if s.scalar(select(Metric.id).where(Metric.assignment_id == assignment_id)) is None:
            s.add(
                Metric(
                    job_id=job_id,
                    epoch=epoch,
                    assignment_id=assignment_id,
                    param_version=version,
                    val_loss=loss,
                    val_accuracy=accuracy,
                )
            )


def validation_losses(db: sessionmaker[Session], job_id: int, latest: int) -> tuple[float, list[float]]:
    """The job's lowest validation loss so far (inf: none) and its `latest` ones, newest last."""
    with db.begin() as s:
        best = s.scalar(select(func.min(Metric.val_loss)).where(Metric.job_id == job_id))
        rows = s.scalars(
            select(Metric.val_loss)
            .where(Metric.job_id == job_id)
            .order_by(Metric.param_version.desc(), Metric.id.desc())
            .limit(latest)
        ).all()
    return (math.inf if best is None else float(best)), [float(loss) for loss in reversed(rows)]


def latest_validation(db: sessionmaker[Session], job_id: int) -> tuple[int, float] | None:
    """The job's newest evaluation: (W_s version, validation loss); None before its first."""
    with db.begin() as s:
        row = s.execute(
            select(Metric.param_version, Metric.val_loss)
            .where(Metric.job_id == job_id)
            .order_by(Metric.param_version.desc(), Metric.id.desc())
            .limit(1)
        ).first()
    return None if row is None else (int(row[0]), float(row[1]))


def restore_server_model(db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int) -> None:
    """Redis lost W_s: put back the newest published snapshot. Merges after it are lost.

    The version continues from the highest one the database has seen, so versions (and snapshot
    keys) are never reused. The merge rule's state (momentum, FedBuff's buffer) is not in the
    snapshot: it is reset, and the next merge starts it again from the rule's initial state.
    """
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        key, snap_version, seen = job.snapshot_key, job.snapshot_version, job.param_version
    assert key is not None and snap_version is not None  # every job publishes v0 when it is created
    version = max(snap_version, seen)
    if store.initialise_blob(r, job_id, storage.get(key), version):
        log.warning(
            "job %s: W_s was missing from Redis; restored snapshot v%d as v%d (%d merges lost)",
            job_id,
            snap_version,
            version,
            version - snap_version,
        )


def last_snapshot(db: sessionmaker[Session], job_id: int) -> tuple[int, float | None]:
    """(version, seconds since it was published, or None) of the job's newest published snapshot."""
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        last_v, last_at = job.snapshot_version or 0, job.snapshot_at
    return last_v, None if last_at is None else (utcnow() - last_at).total_seconds()


def record_snapshot(db: sessionmaker[Session], job_id: int, version: int, key: str, sha256: str) -> bool:
    """The snapshot of W_s `version` at `key` is the one to dispatch; False when a newer one already
    is (another parameter server published it meanwhile)."""
    with db.begin() as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
        if (job.snapshot_version or 0) >= version:
            return False
        job.snapshot_version, job.snapshot_key, job.snapshot_sha256 = version, key, sha256
        job.snapshot_at = utcnow()
    return True


def snapshots_in_use(db: sessionmaker[Session], job_id: int, versions: list[int]) -> set[int]:
    """Those of `versions` that an unmerged assignment started from: its update is measured against it."""
    with db.begin() as s:
        return set(
            s.scalars(
                select(Assignment.base_version)
                .distinct()
                .where(
                    Assignment.job_id == job_id,
                    Assignment.status.in_([AssignmentStatus.in_progress.value, AssignmentStatus.uploaded.value]),
                    Assignment.base_version.in_(versions),
                )
            )
        )
