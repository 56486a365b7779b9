"""One merge of a parameter server: an uploaded result into W_s, and its outcome into the ledger.

`assimilate` reads the upload once from where the scheduler stored it (crowdtrain.assimilator.inputs:
a weights upload the scheduler checked and hashed is neither checked nor hashed again), refuses a
replayed result, has a replicated one voted on (crowdtrain.assimilator.replica_vote), merges it
with the job's rule under the policy every rule obeys (staleness bound, update-norm bound,
clipping: crowdtrain.assimilator.policy), records the outcome, evaluates W_s when due, publishes a
snapshot when due, and closes the epoch when it is complete.

The guarantee: merged exactly once; may be delivered twice. The merge into W_s is exactly once per
assignment, and at most one assignment per workunit (paramstore.merge_once: a straggler's duplicate
that loses ends `superseded`), and every ledger step is idempotent
(crowdtrain.server.ledger.merges), so running `assimilate` again for the same assignment, after a
crash anywhere in it, completes what is missing and changes nothing else. No Celery here: the
task in crowdtrain.assimilator.worker.tasks only wraps it.
"""

import logging
import time
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import redis
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.assimilator.inputs import Refused, Result, read_result, replay_of, replay_reason, validation_set
from crowdtrain.assimilator.policy import Policy, apply_with_policy
from crowdtrain.assimilator.replica_vote import judge_replicas
from crowdtrain.assimilator.rules import Rule, make_rule
from crowdtrain.core.keys import snapshot_key
from crowdtrain.core.logs import ids
from crowdtrain.core.settings import Settings
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.core.tensors import Params, sha256
from crowdtrain.server.ledger import duplicates, merges, paramstore, result_records
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.epochs import close_epoch_if_complete
from crowdtrain.server.services import telemetry

log = logging.getLogger(__name__)

# Failures that go away (a lost database race or connection, Redis unreachable): `assimilate` raises
# them for its caller to run it again. Any other failure ends the assignment (see `_failed`).
TRANSIENT = (OperationalError, redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)


class Superseded(Exception):
    """Another assignment of the same workunit (a straggler and its duplicate) was merged first:
    this result is not merged, and its assignment ends `superseded` (crowdtrain.server.ledger.duplicates)."""

    def __init__(self, winner_id: int | None):
        super().__init__(
            "workunit already merged from " + ("another assignment" if winner_id is None else f"assignment {winner_id}")
        )
        self.winner_id = winner_id


class Judged(Exception):
    """The result's workunit is replicated and this call judged (or awaits) its replicas: the outcome
    for this assignment is `result`, and nothing more is recorded for it here."""

    def __init__(self, result: "MergeResult"):
        super().__init__(result.reason)
        self.result = result


class JobBroken(Exception):
    """The job itself cannot take merges (its validation set does not fit its model, ...): every
    merge would fail the same way, so the job fails with this message."""


class Outcome(StrEnum):
    merged = "merged"  # merged into W_s by this call, and recorded
    already_merged = "already merged"  # an earlier delivery merged it; what it left unrecorded is recorded
    refused = "refused"  # not merged; the assignment is rejected (or was already ended)
    superseded = "superseded"  # not merged: another assignment of its workunit was merged first
    nothing_to_merge = "nothing to merge"  # unknown assignment, or no longer uploaded
    awaiting_replicas = "awaiting replicas"  # replicated: not judged until its quorum of results is in
    validated = "validated"  # a replica that agreed with another, which was merged
    failed = "failed"  # a failure that retrying would not remove; the assignment is ended


@dataclass(frozen=True)
class MergeResult:
    """What one call of `assimilate` did."""

    outcome: Outcome
    version: int | None = None  # the W_s version that holds the result (merged, already merged)
    reason: str = ""  # why it was refused or failed


@dataclass(frozen=True)
class MergeServices:
    """What a merge works with: the ledger, object storage, Redis (W_s) and the snapshots to keep."""

    db: sessionmaker[Session]
    storage: Storage
    r: redis.Redis
    snapshots_kept: int

    @classmethod
    def from_settings(cls, settings: Settings) -> "MergeServices":
        return cls(
            session_factory(settings.resolved_database_url),
            open_storage(settings.resolved_storage_url, settings.s3_endpoint_url),
            paramstore.connect(settings.redis_url),
            settings.snapshots_kept,
        )


def assimilate(svc: MergeServices, assignment_id: int, received_at: float | None = None) -> MergeResult:
    """Merge the uploaded result of `assignment_id` into W_s and record what happened.

    Merged exactly once; may be delivered twice: a second call for the same assignment merges
    nothing again and completes the recording an earlier one left unfinished. A refused result
    (stale, too large, malformed, or its job no longer running) leaves W_s unchanged. Raises only
    TRANSIENT errors, after which the caller runs it again; any other failure ends the assignment
    (and, when the job is at fault, the job) and is returned as `failed`.
    """
    try:
        return _assimilate(svc, assignment_id, received_at)
    except TRANSIENT:
        raise
    except Exception as exc:
        return _failed(svc, assignment_id, exc)


def _assimilate(svc: MergeServices, assignment_id: int, received_at: float | None) -> MergeResult:
    pending = merges.pending_merge(svc.db, assignment_id)
    if pending is None:
        return MergeResult(Outcome.nothing_to_merge)
    if not paramstore.has_server_model(svc.r, pending.job_id):
        merges.restore_server_model(svc.db, svc.storage, svc.r, pending.job_id)
    version = paramstore.merged_version(svc.r, pending.job_id, assignment_id)
    if pending.already_merged or version is not None:
        # W_s restored from an older snapshot may have lost the merge the ledger recorded: v0 stands in.
        result = MergeResult(Outcome.already_merged, version or 0)
    else:
        try:
            result = _merge_new(svc, pending, received_at)
        except Refused as exc:
            return _refuse(svc, assignment_id, exc)
        except Superseded as exc:
            return _supersede(svc, assignment_id, exc)
        except Judged as exc:
            return exc.result
    assert result.version is not None  # a merged or already merged result names the W_s version holding it
    _record(svc, pending, result.version)
    return result


def _merge_new(svc: MergeServices, p: merges.PendingMerge, received_at: float | None) -> MergeResult:
    """Merge a result that no delivery has merged yet; raises Refused when it must not be, and
    Superseded when another assignment of its workunit was merged first."""
    if not p.job_running:
        raise Refused("job is no longer running", charge=False)
    if p.workunit_done:
        raise Superseded(None)
    if not p.workunit_open:
        raise Refused("workunit already done by another assignment", charge=False)
    try:
        result: Result | None = read_result(svc.storage, svc.r, p)
        unreadable = None
    except Refused as exc:  # left to refuse below, after a replicated result's vote
        result, unreadable = None, exc
    # The digest is noted first, whether replicated or not, so that an original precedes its replays.
    replayed = None if result is None else replay_of(svc.r, p.job_id, p.assignment_id, result.digest)
    if p.quorum > 1 and p.canonical != p.assignment_id:
        _vote(svc, p, received_at)  # raises Judged, or returns when this result is the one to merge
    elif replayed is not None:
        raise Refused(replay_reason(replayed), charge=True)
    if result is None:
        assert unreadable is not None
        raise unreadable
    norm = result.norm
    assimilation = p.spec["assimilation"]
    rule = make_rule(assimilation)
    merge = _guarded(svc.r, p, rule, Policy.from_spec(assimilation), result, norm)
    try:
        outcome = paramstore.merge_once(
            svc.r,
            p.job_id,
            p.assignment_id,
            merge,
            received_at,
            update_norm=norm,
            initial_state=rule.initial_state,
            workunit_id=p.workunit_id,
        )
    except paramstore.MergesClosed:
        raise Refused("job is no longer running", charge=False) from None
    except paramstore.WorkunitMerged as exc:
        raise Superseded(exc.assignment_id) from None
    if not outcome.applied_now:
        return MergeResult(Outcome.already_merged, outcome.version)
    telemetry.count(svc.r, "merges")
    if received_at:
        telemetry.observe_merge_latency(svc.r, time.time() - received_at)
    return MergeResult(Outcome.merged, outcome.version)


def _vote(svc: MergeServices, p: merges.PendingMerge, received_at: float | None) -> None:
    """The replica vote (crowdtrain.assimilator.replica_vote) for a replicated result: returns when `p`
    is the canonical replica, for the caller to merge it; merges the canonical one when it is
    another's (its own merge ended while it waited); raises Judged with this assignment's outcome."""
    vote = judge_replicas(svc.db, svc.storage, svc.r, p)
    if vote.canonical == p.assignment_id:
        return
    if vote.canonical is not None:
        _assimilate(svc, vote.canonical, received_at)
    if vote.refused is not None:
        raise Judged(MergeResult(Outcome.refused, reason=vote.refused))
    if vote.canonical is not None:
        raise Judged(MergeResult(Outcome.validated, reason=f"agrees with replica {vote.canonical}"))
    raise Judged(MergeResult(Outcome.awaiting_replicas))


def _guarded(
    r: redis.Redis, p: merges.PendingMerge, rule: Rule, policy: Policy, result: Result, norm: float
) -> paramstore.Merge:
    """The rule wrapped in the policy every rule obeys: refuse stale results and too large updates,
    clip. Run inside merge_once's transaction, perhaps more than once: only the staleness, which
    depends on the version W_s has then, and the recent norms are taken anew each time."""

    def merge(server: Params, state: Params, version: int) -> Params:
        now = replace(result.update, staleness=version - p.base_version)
        recent = paramstore.recent_update_norms(r, p.job_id)
        refusal = apply_with_policy(policy, rule, server, state, now, version, norm, recent, result.base_norm)
        if refusal:
            raise Refused(refusal, charge=True)
        return server

    return merge


def _refuse(svc: MergeServices, assignment_id: int, refused: Refused) -> MergeResult:
    """Reject the result: its workunit is ready again (or failed, when charged up to max_errors)."""
    if merges.reject_result(svc.db, svc.storage, svc.r, assignment_id, refused.reason, refused.charge, evaluate):
        telemetry.count(svc.r, "rejections")
    return MergeResult(Outcome.refused, reason=refused.reason)


def _supersede(svc: MergeServices, assignment_id: int, superseded: Superseded) -> MergeResult:
    """End the result `superseded` and delete its upload: W_s holds its workunit from another assignment."""
    upload_key = duplicates.supersede_result(svc.db, assignment_id, superseded.winner_id)
    if upload_key:
        svc.storage.delete(upload_key)
    return MergeResult(Outcome.superseded, reason=str(superseded))


def _record(svc: MergeServices, p: merges.PendingMerge, version: int) -> None:
    """Record a result that W_s `version` holds. The metric is recorded before the workunit is marked
    done: when an epoch's last workunit is done, every one of its merges has its validation figure."""
    sched = p.spec["scheduling"]
    if version % sched["eval_every"] == 0:
        _record_metric(svc, p)
    _publish_snapshot_if_due(svc, p.job_id, sched, version)
    for key in [p.upload_key, *merges.record_merge(svc.db, p.assignment_id, version)]:
        svc.storage.delete(key)
    result_records.forget_checked_upload(svc.r, p.job_id, p.upload_key)
    close_epoch_if_complete(svc.db, svc.storage, svc.r, p.job_id, p.epoch, evaluate)


def _record_metric(svc: MergeServices, p: merges.PendingMerge) -> None:
    """Evaluate W_s on the job's validation set, once per merge; JobBroken when that cannot work."""
    validation_key = merges.unmeasured_validation_key(svc.db, p.job_id, p.assignment_id)
    if validation_key is None:
        return
    version, params = paramstore.read(svc.r, p.job_id)
    try:
        x, y = validation_set(svc.storage, validation_key)
        loss, acc = evaluate(p.job_id, p.model_config, params, x, y)
    except TRANSIENT:
        raise
    except Exception as exc:
        raise JobBroken(
            f"evaluating W_s v{version} on the job's validation set failed: {type(exc).__name__}: {exc}"
        ) from exc
    merges.record_metric(svc.db, p.job_id, p.epoch, p.assignment_id, version, loss, acc)
    log.info("job %s: W_s v%d validation accuracy %.4f loss %.4f (epoch %d)", p.job_id, version, acc, loss, p.epoch)


def _publish_snapshot_if_due(svc: MergeServices, job_id: int, sched: dict[str, Any], version: int) -> None:
    """Publish W_s for dispatch at most once per `snapshot_every_merges` merges or seconds."""
    last_v, age = merges.last_snapshot(svc.db, job_id)
    due = version - last_v >= sched["snapshot_every_merges"] or (
        age is not None and age >= sched["snapshot_every_seconds"]
    )
    if version <= last_v or not due:
        return
    current, blob = paramstore.read_blob(svc.r, job_id)
    key = snapshot_key(job_id, current)
    svc.storage.put(key, blob)
    if not merges.record_snapshot(svc.db, job_id, current, key, sha256(blob)):
        return
    # Only the newest few snapshots are kept, and none that an unmerged assignment started from.
    expired = paramstore.note_snapshot(svc.r, job_id, current, svc.snapshots_kept)
    if not expired:
        return
    in_use = merges.snapshots_in_use(svc.db, job_id, expired)
    for old in expired:
        if old in in_use:
            paramstore.keep_snapshot(svc.r, job_id, old)
        else:
            svc.storage.delete(snapshot_key(job_id, old))


def _failed(svc: MergeServices, assignment_id: int, exc: Exception) -> MergeResult:
    """A merge failed for a reason that retrying will not remove: end the assignment, so that nothing
    queues it again, and fail the job when the cause is its own (crowdtrain.server.ledger.merges)."""
    cause = str(exc) if isinstance(exc, JobBroken) else f"{type(exc).__name__}: {exc}"
    log.error(
        "assignment %s: merge failed: %s", assignment_id, cause, exc_info=exc, extra=ids(assignment_id=assignment_id)
    )
    if merges.end_failed_merge(svc.db, svc.storage, svc.r, assignment_id, cause, isinstance(exc, JobBroken), evaluate):
        telemetry.count(svc.r, "rejections")
    return MergeResult(Outcome.failed, reason=cause)
