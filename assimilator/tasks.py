"""The Celery task of a parameter server: validate one uploaded result and merge it into W_s.

Delivery is at least once (late acks, redelivery when a worker dies); the merge itself is exactly
once per assignment (paramstore.merge_once), and every database step below is idempotent.
"""

import logging
import time
from functools import lru_cache

import numpy as np
import redis
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from assimilator import paramstore
from assimilator.celery_app import ASSIMILATE_TASK, celery_app
from assimilator.epochs import close_epoch_if_complete, fail_job
from assimilator.evaluate import evaluate
from assimilator.policy import Policy, apply_with_policy, params_norm
from assimilator.rules import Rule, Update, make_rule, update_norm
from crowdtrain.logs import ids
from crowdtrain.settings import get_settings
from crowdtrain.storage import ObjectNotFound, Storage, open_storage
from crowdtrain.tensors import Params, TensorFormatError, decode, decode_shard, sha256
from crowdtrain.updates import decode_result, upload_of
from server import states, telemetry
from server.db import session_factory
from server.models import Assignment, Host, Job, Metric, Workunit, utcnow
from server.results import end_assignment
from server.states import AssignmentStatus, JobStatus, WorkunitStatus
from workgen.generator import snapshot_key

log = logging.getLogger(__name__)


class Refused(Exception):
    """The result is well-formed but must not be merged (stale, too large an update, unusable)."""


class JobBroken(Exception):
    """The job itself cannot take merges (its validation set does not fit its model, ...): every
    merge would fail the same way, so the job fails with this message."""


# Failures that go away: the task runs again. Anything else ends the assignment (see _merge_failed).
TRANSIENT = (OperationalError, redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)
MERGE_FAILURES_BEFORE_JOB_FAILS = 3


@lru_cache
def _services():
    settings = get_settings()
    return (session_factory(settings.resolved_database_url),
            open_storage(settings.resolved_storage_url, settings.s3_endpoint_url),
            paramstore.connect(settings.redis_url))


@lru_cache(maxsize=8)
def _validation_set(storage: Storage, key: str) -> tuple[np.ndarray, np.ndarray]:
    return decode_shard(storage.get(key))


@lru_cache(maxsize=4)
def _base_snapshot(storage: Storage, key: str) -> tuple[Params, float]:
    """A published W_s snapshot (read-only) and its norm: what results based on it are measured against."""
    params = decode(storage.get(key))
    return params, params_norm(params)


# Every step is idempotent, so a task that lost a database race (deadlock, serialization) or the
# connection simply runs again. A failure that would recur ends the assignment instead: otherwise
# the transitioner would queue it again every `stuck_upload_seconds`, forever.
@celery_app.task(name=ASSIMILATE_TASK, acks_late=True, reject_on_worker_lost=True,
                 autoretry_for=TRANSIENT, retry_backoff=0.5, max_retries=10)
def assimilate(assignment_id: int, received_at: float | None = None) -> None:
    try:
        _assimilate(assignment_id, received_at)
    except TRANSIENT:
        raise
    except Exception as exc:
        _merge_failed(assignment_id, exc)


def _assimilate(assignment_id: int, received_at: float | None) -> None:
    db, storage, r = _services()
    with db.begin() as s:
        a = s.get(Assignment, assignment_id)
        if a is None or a.status not in (AssignmentStatus.uploaded.value, AssignmentStatus.merged.value):
            log.info("assignment %s: nothing to merge (%s)", assignment_id, "unknown" if a is None else a.status)
            return
        job = s.get_one(Job, a.job_id)
        wu = s.get_one(Workunit, a.workunit_id)
        job_id, epoch, spec, model_config, upload_key = job.id, wu.epoch, job.spec, job.model_config_, a.upload_key
        job_running = job.status == JobStatus.running.value
        wu_open = wu.status == WorkunitStatus.in_progress.value
        already_merged = a.status == AssignmentStatus.merged.value

    if not paramstore.has_server_model(r, job_id):
        restore_server_model(db, storage, r, job_id)
    version = paramstore.merged_version(r, job_id, assignment_id)
    if not already_merged and version is None:
        if not job_running:
            return _reject(assignment_id, "job is no longer running", charge=False)
        if not wu_open:
            return _reject(assignment_id, "workunit already done by another assignment", charge=False)
        version = _merge_result(assignment_id, epoch, received_at)
        if version is None:
            return
    version = version or 0

    # The metric is recorded before the workunit is marked done: when an epoch's last workunit is
    # done, every one of its merges already has its validation figure.
    if version % spec["scheduling"]["eval_every"] == 0:
        _record_metric(job_id, epoch, assignment_id, model_config)
    _publish_snapshot_if_due(job_id, spec["scheduling"], version)
    _record_merge(assignment_id, version)
    storage.delete(upload_key)
    close_epoch_if_complete(db, storage, r, job_id, epoch)


def _merge_result(assignment_id: int, epoch: int, received_at: float | None) -> int | None:
    """Check an uploaded result and merge it; the new W_s version, or None when it was rejected."""
    db, storage, r = _services()
    with db.begin() as s:
        a = s.get_one(Assignment, assignment_id)
        job = s.get_one(Job, a.job_id)
        job_id, base_version, upload_key = job.id, a.base_version, a.upload_key
        spec, manifest = job.spec, job.param_manifest
    try:
        blob = storage.get(upload_key)
    except ObjectNotFound:
        return _reject(assignment_id, f"the upload {upload_key} is missing from storage; the workunit "
                                      "will be dispatched again", charge=False)
    try:
        base, base_norm = _base_snapshot(storage, snapshot_key(job_id, base_version))
    except ObjectNotFound:
        return _reject(assignment_id, f"the snapshot v{base_version} this result started from is gone, so its "
                                      "update cannot be checked; the workunit will be dispatched again",
                       charge=False)
    try:
        client = decode_result(blob, manifest, upload_of(spec["assimilation"]), base)  # W_c, also from a Δ
    except (TensorFormatError, ValueError) as exc:
        return _reject(assignment_id, f"invalid result: {exc}", charge=True)
    norm = update_norm(base, client)
    rule = make_rule(spec["assimilation"])
    merge = _guarded(rule, client, base, epoch, r, job_id, spec["assimilation"], base_version, norm, base_norm)
    try:
        outcome = paramstore.merge_once(r, job_id, assignment_id, merge, received_at, update_norm=norm,
                                        initial_state=rule.initial_state)
    except Refused as exc:
        return _reject(assignment_id, str(exc), charge=True)
    except paramstore.MergesClosed:
        return _reject(assignment_id, "job is no longer running", charge=False)
    if outcome.applied_now:
        telemetry.count(r, "merges")
        if received_at:
            telemetry.observe_merge_latency(r, time.time() - received_at)
    return outcome.version


def _merge_failed(assignment_id: int, exc: Exception) -> None:
    """A merge failed for a reason that retrying will not remove: end the assignment, so that
    nothing queues it again, and fail the job when the cause is the job's own (JobBroken) or when
    MERGE_FAILURES_BEFORE_JOB_FAILS merges in a row have failed."""
    db, storage, r = _services()
    with db.begin() as s:
        a = s.get(Assignment, assignment_id)
        job_id = None if a is None else a.job_id
    cause = str(exc) if isinstance(exc, JobBroken) else f"{type(exc).__name__}: {exc}"
    log.error("assignment %s: merge failed: %s", assignment_id, cause, exc_info=exc,
              extra=ids(job_id=job_id, assignment_id=assignment_id))
    if job_id is None:
        return
    version = paramstore.merged_version(r, job_id, assignment_id)
    if version is not None:
        _record_merge(assignment_id, version)  # W_s includes it: the ledger says so
    else:
        _reject(assignment_id, f"merge failed on the server: {cause}", charge=False)
    if isinstance(exc, JobBroken):
        fail_job(db, storage, r, job_id, cause)
    elif (failures := paramstore.count_merge_failure(r, job_id)) >= MERGE_FAILURES_BEFORE_JOB_FAILS:
        fail_job(db, storage, r, job_id, f"{failures} merges in a row failed on the server; the last: {cause}")


def restore_server_model(db, storage: Storage, r, job_id: int) -> None:
    """Redis lost W_s: put back the newest published snapshot. Merges after it are lost.

    The version continues from the highest one the database has seen, so versions (and snapshot
    keys) are never reused. The merge rule's state (momentum, FedBuff's buffer) is not in the
    snapshot: it is reset, and the next merge starts it again from the rule's initial state.
    """
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        key, snap_version, seen = job.snapshot_key, job.snapshot_version, job.param_version
    version = max(snap_version, seen)
    if paramstore.initialise_blob(r, job_id, storage.get(key), version):
        log.warning("job %s: W_s was missing from Redis; restored snapshot v%d as v%d (%d merges lost)",
                    job_id, snap_version, version, version - snap_version)


def _guarded(rule: Rule, client: Params, base: Params, epoch: int, r, job_id: int, assimilation: dict,
             base_version: int, norm: float, base_norm: float) -> paramstore.Merge:
    """The rule wrapped in the policy every rule obeys: refuse stale results and too large updates, clip."""
    policy = Policy.from_spec(assimilation)

    def merge(server: Params, state: Params, version: int) -> Params:
        delta = {k: client[k] - v for k, v in base.items() if v.dtype.kind == "f"}
        update = Update(client, delta, version - base_version, epoch)
        refusal = apply_with_policy(policy, rule, server, state, update, version, norm,
                                    paramstore.recent_update_norms(r, job_id), base_norm)
        if refusal:
            raise Refused(refusal)
        return server

    return merge


def _reject(assignment_id: int, message: str, charge: bool) -> None:
    """Refuse a result: its workunit is ready again (or failed, when `charge` reaches max_errors)."""
    db, storage, r = _services()
    with db.begin() as s:
        a = s.get_one(Assignment, assignment_id, with_for_update=True)
        if a.status != AssignmentStatus.uploaded.value:
            return
        wu = end_assignment(s, a, AssignmentStatus.rejected, message, charge=charge)
        job_id, epoch, failed = a.job_id, wu.epoch, wu.status == WorkunitStatus.failed.value
        upload_key = a.upload_key
    if upload_key:
        storage.delete(upload_key)
    telemetry.count(r, "rejections")
    log.warning("assignment %s: rejected, %s", assignment_id, message,
                extra=ids(job_id=job_id, epoch=epoch, assignment_id=assignment_id))
    if failed:
        close_epoch_if_complete(db, storage, r, job_id, epoch)


def _record_merge(assignment_id: int, version: int) -> None:
    db, _, _ = _services()
    with db.begin() as s:
        a = s.get_one(Assignment, assignment_id, with_for_update=True)
        if a.status == AssignmentStatus.merged.value:
            return
        if a.status != AssignmentStatus.uploaded.value:
            # Ended meanwhile (its job was cancelled or finished): W_s has it, the ledger cannot.
            log.warning("assignment %s: merged into W_s v%d after it was ended (%s)", assignment_id, version,
                        a.status, extra=ids(job_id=a.job_id, assignment_id=assignment_id))
            return
        host = s.get_one(Host, a.host_id, with_for_update=True)  # lock order: see server/results.py
        states.move(a, AssignmentStatus.merged)
        a.merged_version, a.finished_at = version, utcnow()
        wu = s.get_one(Workunit, a.workunit_id, with_for_update=True)
        if wu.status == WorkunitStatus.in_progress.value:
            states.move(wu, WorkunitStatus.done)
            wu.finished_at = a.finished_at
        job = s.scalars(select(Job).where(Job.id == a.job_id).with_for_update()).one()
        job.param_version = max(job.param_version, version)
        host.results_valid += 1
        host.consecutive_valid += 1
        turnaround = (a.finished_at - a.sent_at).total_seconds()
        host.mean_turnaround = turnaround if host.mean_turnaround is None else (
            0.8 * host.mean_turnaround + 0.2 * turnaround)
    log.info("assignment %s: merged into W_s v%d", assignment_id, version,
             extra=ids(job_id=a.job_id, workunit_id=a.workunit_id, assignment_id=assignment_id))


def _publish_snapshot_if_due(job_id: int, sched: dict, version: int) -> None:
    """Publish W_s for dispatch at most once per `snapshot_every_merges` merges or seconds."""
    db, storage, r = _services()
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        last_v, last_at = job.snapshot_version or 0, job.snapshot_at
    due = (version - last_v >= sched["snapshot_every_merges"]
           or (last_at is not None and (utcnow() - last_at).total_seconds() >= sched["snapshot_every_seconds"]))
    if version <= last_v or not due:
        return
    current, blob = paramstore.read_blob(r, job_id)
    key = snapshot_key(job_id, current)
    storage.put(key, blob)
    with db.begin() as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()
        if (job.snapshot_version or 0) >= current:
            return  # another parameter server published a newer one meanwhile
        job.snapshot_version, job.snapshot_key, job.snapshot_sha256 = current, key, sha256(blob)
        job.snapshot_at = utcnow()
    # Only the newest few snapshots are kept, and none that an unmerged assignment started from: its
    # update is measured against it.
    expired = paramstore.note_snapshot(r, job_id, current, get_settings().snapshots_kept)
    if expired:
        with db.begin() as s:
            in_use = set(s.scalars(select(Assignment.base_version).distinct().where(
                Assignment.job_id == job_id,
                Assignment.status.in_([AssignmentStatus.in_progress.value, AssignmentStatus.uploaded.value]),
                Assignment.base_version.in_(expired))))
        for old in expired:
            if old in in_use:
                paramstore.keep_snapshot(r, job_id, old)
            else:
                storage.delete(snapshot_key(job_id, old))


def _record_metric(job_id: int, epoch: int, assignment_id: int, model_config: dict) -> None:
    db, storage, r = _services()
    with db.begin() as s:
        if s.scalar(select(Metric.id).where(Metric.assignment_id == assignment_id)) is not None:
            return
        validation_key = s.get_one(Job, job_id).validation_key
    version, params = paramstore.read(r, job_id)
    try:
        x, y = _validation_set(storage, validation_key)
        loss, acc = evaluate(job_id, model_config, params, x, y)
    except TRANSIENT:
        raise
    except Exception as exc:
        raise JobBroken(f"evaluating W_s v{version} on the job's validation set failed: "
                        f"{type(exc).__name__}: {exc}") from exc
    with db.begin() as s:
        if s.scalar(select(Metric.id).where(Metric.assignment_id == assignment_id)) is None:
            s.add(Metric(job_id=job_id, epoch=epoch, assignment_id=assignment_id, param_version=version,
                         val_loss=loss, val_accuracy=acc))
    log.info("job %s: W_s v%d validation accuracy %.4f loss %.4f (epoch %d)", job_id, version, acc, loss, epoch)


__all__ = ["assimilate"]
