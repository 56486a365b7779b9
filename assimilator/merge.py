"""One merge of a parameter server: an uploaded result into W_s, and its outcome into the ledger.

`assimilate` loads the upload, decodes its update once, checks it against the snapshot the host
started from, merges it with the job's rule under the policy every rule obeys (staleness bound,
update-norm bound, clipping: crowdtrain.assimilator.policy), records the outcome, evaluates W_s
when due, publishes a snapshot when due, and closes the epoch when it is complete.

The guarantee: merged exactly once; may be delivered twice. The merge into W_s is exactly once per
assignment, and at most one assignment per workunit (paramstore.merge_once: a straggler's duplicate
that loses ends `superseded`), and every ledger step is idempotent
(crowdtrain.server.ledger.merges), so running `assimilate` again for the same assignment, after a
crash anywhere in it, completes what is missing and changes nothing else. No Celery here: the
task in crowdtrain.assimilator.worker.tasks only wraps it.
"""

import hashlib
import logging
import time
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import lru_cache
from typing import Any

import numpy as np
import redis
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator import validator
from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.assimilator.policy import Policy, apply_with_policy, merged_alone, params_norm
from crowdtrain.assimilator.rules import Rule, Update, make_rule, make_update
from crowdtrain.core.jobspec import ValidationSpec, validation_of
from crowdtrain.core.keys import snapshot_key, validation_key
from crowdtrain.core.logs import ids
from crowdtrain.core.settings import Settings
from crowdtrain.core.storage import ObjectNotFound, Storage, open_storage
from crowdtrain.core.tensors import Params, TensorFormatError, check_against_manifest, decode, decode_shard, sha256
from crowdtrain.core.updates import decode_update, upload_of
from crowdtrain.server.ledger import duplicates, merges, paramstore, replicas
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.epochs import close_epoch_if_complete, close_epochs_after_failure
from crowdtrain.server.services import telemetry

log = logging.getLogger(__name__)

# Failures that go away (a lost database race or connection, Redis unreachable): `assimilate` raises
# them for its caller to run it again. Any other failure ends the assignment (see `_failed`).
TRANSIENT = (OperationalError, redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)


class Refused(Exception):
    """The result must not be merged (stale, too large an update, malformed, its inputs gone).
    `charge`: whether the refusal counts against its workunit and host."""

    def __init__(self, reason: str, charge: bool):
        super().__init__(reason)
        self.reason, self.charge = reason, charge


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


@lru_cache(maxsize=8)
def _validation_set(storage: Storage, key: str) -> tuple[np.ndarray, np.ndarray]:
    return decode_shard(storage.get(key))


@lru_cache(maxsize=4)
def _base_snapshot(storage: Storage, key: str) -> tuple[Params, float]:
    """A published W_s snapshot (read-only) and its norm: what results based on it are measured against."""
    params = decode(storage.get(key))
    return params, params_norm(params)


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
    replayed = _replay_of(svc, p)  # noted first, whether replicated or not, so that an original precedes its replays
    if p.quorum > 1 and p.canonical != p.assignment_id:
        _judge_replicas(svc, p, received_at)  # raises Judged, or returns when this result is the one to merge
    elif replayed is not None:
        raise Refused(_replay_reason(replayed), charge=True)
    update, base_norm = _checked_update(svc.storage, p)
    norm = params_norm(update.delta)
    assimilation = p.spec["assimilation"]
    rule = make_rule(assimilation)
    merge = _guarded(svc.r, p, rule, Policy.from_spec(assimilation), update, norm, base_norm)
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


def _checked_update(storage: Storage, p: merges.PendingMerge) -> tuple[Update, float]:
    """The result as an `Update` (its Δ decoded once, its staleness still 0) and ||W_base||.

    Raises Refused, uncharged, when the upload or the snapshot it started from is gone, and,
    charged, when the upload is malformed (not the model's tensors, or not finite once applied).
    """
    try:
        blob = storage.get(p.upload_key)
    except ObjectNotFound:
        raise Refused(
            f"the upload {p.upload_key} is missing from storage; the workunit will be dispatched again", charge=False
        ) from None
    try:
        base, base_norm = _base_snapshot(storage, snapshot_key(p.job_id, p.base_version))
    except ObjectNotFound:
        raise Refused(
            f"the snapshot v{p.base_version} this result started from is gone, so its update cannot be "
            "checked; the workunit will be dispatched again",
            charge=False,
        ) from None
    upload = upload_of(p.spec["assimilation"])
    try:
        update = make_update(base, decode_update(blob, p.manifest, upload), upload.send, 0, p.epoch)
        if upload.send != "weights":
            check_against_manifest(update.client, p.manifest)  # W_base + Δ may overflow
    except (TensorFormatError, ValueError) as exc:
        raise Refused(f"invalid result: {exc}", charge=True) from None
    return update, base_norm


def _digest(params: Params) -> str:
    """sha256 over W_c's tensors, by name: the same weights give the same digest however they travelled."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode() + b"\0" + np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()


def _replay_of(svc: MergeServices, p: merges.PendingMerge) -> int | None:
    """The earlier assignment of the job whose result had exactly this result's W_c (a host uploading
    an old result again), else None; this result's W_c is noted for those after it. A result that
    cannot be read is left to the checks that refuse it."""
    try:
        update, _ = _checked_update(svc.storage, p)
    except Refused:
        return None
    first = paramstore.first_with_digest(svc.r, p.job_id, _digest(update.client), p.assignment_id)
    return None if first == p.assignment_id else first


def _replay_reason(first: int) -> str:
    return f"its weights are those of assignment {first}'s result: a replayed result"


def _judge_replicas(svc: MergeServices, p: merges.PendingMerge, received_at: float | None) -> None:
    """Judge the workunit's replicas once `quorum` of them are uploaded (crowdtrain.assimilator.validator)
    and record the verdict; merge the canonical one when it is another's (its own merge ended while
    it waited). Returns when `p` is the canonical replica, for the caller to merge it; raises Judged
    with this assignment's outcome otherwise."""
    uploaded = replicas.uploads(svc.db, p.workunit_id)
    if len(uploaded) < p.quorum:
        log.info(
            "assignment %s: %d of %d replicas uploaded; waiting for the others",
            p.assignment_id,
            len(uploaded),
            p.quorum,
            extra=ids(job_id=p.job_id, workunit_id=p.workunit_id, assignment_id=p.assignment_id),
        )
        raise Judged(MergeResult(Outcome.awaiting_replicas))
    spec = validation_of(p.spec)
    measured, malformed, flat, base_loss = _measure_replicas(svc, p, uploaded, spec)
    verdict = validator.judge(measured, validator.cosines(flat), base_loss, spec)
    if verdict.more and malformed:
        # A malformed replica ends the vote: the others are judged as at the bound (inconclusive unless
        # two agree), never left valid by default.
        bound = spec.model_copy(update={"max_replicas": len(measured)})
        verdict = validator.judge(measured, validator.cosines(flat), base_loss, bound)
    invalid = {**verdict.invalid, **malformed}
    record = replicas.record_verdict(
        svc.db,
        p.workunit_id,
        [u.assignment_id for u in uploaded],
        verdict.canonical if verdict.canonical not in malformed else None,
        verdict.more and not malformed,
        invalid,
        verdict.charged | frozenset(malformed),
        spec.max_replicas,
    )
    for key in record.ended:
        svc.storage.delete(key)
    if record.failed_workunit:
        close_epochs_after_failure(svc.db, svc.storage, svc.r, [(p.job_id, p.epoch)], evaluate)
    if record.canonical == p.assignment_id:
        return
    if record.canonical is not None:
        _assimilate(svc, record.canonical, received_at)
    if p.assignment_id in invalid and record.decided:
        raise Judged(MergeResult(Outcome.refused, reason=invalid[p.assignment_id]))
    if record.canonical is not None:
        raise Judged(MergeResult(Outcome.validated, reason=f"agrees with replica {record.canonical}"))
    raise Judged(MergeResult(Outcome.awaiting_replicas))


def _measure_replicas(
    svc: MergeServices, p: merges.PendingMerge, uploaded: list[replicas.Upload], spec: ValidationSpec
) -> tuple[list[validator.Replica], dict[int, str], dict[int, np.ndarray], float]:
    """Each replica's ||Δ|| and the held-out loss of W_s after the job's rule merged it alone
    (crowdtrain.assimilator.policy.merged_alone), its flat Δ, and the held-out loss of W_s itself; a
    result that cannot be read as an update is invalid at once (assignment id -> why)."""
    version, server = paramstore.read(svc.r, p.job_id)
    _, state = paramstore.read_state(svc.r, p.job_id)
    assimilation = p.spec["assimilation"]
    rule, policy = make_rule(assimilation), Policy.from_spec(assimilation)
    state = rule.initial_state(server) if state is None else state
    x, y = _holdout(svc, p, spec)
    measured, malformed, flat = [], {}, {}
    for u in uploaded:
        try:
            update, _ = _checked_update(
                svc.storage,
                replace(p, assignment_id=u.assignment_id, base_version=u.base_version, upload_key=u.upload_key),
            )
        except Refused as exc:
            malformed[u.assignment_id] = exc.reason
            continue
        first = paramstore.first_with_digest(svc.r, p.job_id, _digest(update.client), u.assignment_id)
        if first != u.assignment_id:
            malformed[u.assignment_id] = _replay_reason(first)
            continue
        moved = merged_alone(policy, rule, server, state, replace(update, staleness=version - u.base_version))
        loss, _ = evaluate(p.job_id, p.model_config, moved, x, y)
        flat[u.assignment_id] = validator.flat_update(update.delta)
        measured.append(validator.Replica(u.assignment_id, float(np.linalg.norm(flat[u.assignment_id])), loss))
    base_loss, _ = evaluate(p.job_id, p.model_config, server, x, y)
    return measured, malformed, flat, base_loss


def _holdout(svc: MergeServices, p: merges.PendingMerge, spec: ValidationSpec) -> tuple[np.ndarray, np.ndarray]:
    x, y = _validation_set(svc.storage, validation_key(p.job_id))
    return x[: spec.holdout_examples], y[: spec.holdout_examples]


def _guarded(
    r: redis.Redis, p: merges.PendingMerge, rule: Rule, policy: Policy, update: Update, norm: float, base_norm: float
) -> paramstore.Merge:
    """The rule wrapped in the policy every rule obeys: refuse stale results and too large updates,
    clip. Run inside merge_once's transaction, perhaps more than once: only the staleness, which
    depends on the version W_s has then, and the recent norms are taken anew each time."""

    def merge(server: Params, state: Params, version: int) -> Params:
        now = replace(update, staleness=version - p.base_version)
        refusal = apply_with_policy(
            policy, rule, server, state, now, version, norm, paramstore.recent_update_norms(r, p.job_id), base_norm
        )
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
    close_epoch_if_complete(svc.db, svc.storage, svc.r, p.job_id, p.epoch, evaluate)


def _record_metric(svc: MergeServices, p: merges.PendingMerge) -> None:
    """Evaluate W_s on the job's validation set, once per merge; JobBroken when that cannot work."""
    validation_key = merges.unmeasured_validation_key(svc.db, p.job_id, p.assignment_id)
    if validation_key is None:
        return
    version, params = paramstore.read(svc.r, p.job_id)
    try:
        x, y = _validation_set(svc.storage, validation_key)
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
