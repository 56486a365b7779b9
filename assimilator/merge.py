"""Merging uploaded results into W_s, one or a job's queue at a time, and their outcomes into the ledger.

`assimilate_many` merges results of one job in one pass: it reads each upload once from where the
scheduler stored it (crowdtrain.assimilator.inputs: a weights upload the scheduler checked and
hashed is neither checked nor hashed again), refuses a replayed result, has a replicated one voted
on (crowdtrain.assimilator.replica_vote; the canonical replica a vote chooses joins the pass),
merges them in order with the job's rule under the policy every rule obeys (staleness bound,
update-norm bound, clipping: crowdtrain.assimilator.policy) into W_s read once and written once, records
each outcome, evaluates W_s when due (once per pass, not once per merge), publishes a snapshot when
due, and closes the epochs that are complete (record_merged, with
crowdtrain.server.ledger.epochs.close_epoch_if_complete). `assimilate` is a pass of one result.

The guarantee: merged exactly once; may be delivered twice. The merge into W_s is exactly once per
assignment, and at most one assignment per workunit (crowdtrain.server.paramstore.merging.merge_batch: a straggler's
duplicate that loses ends `superseded`), and every ledger step is idempotent
(crowdtrain.server.ledger.merges), so running a pass again for the same assignments, after a crash
anywhere in it, completes what is missing and changes nothing else. Each result's outcome is a
value (MergeResult); an exception is a failure. No Celery here: the task in
crowdtrain.assimilator.worker.tasks only wraps crowdtrain.assimilator.merge_pass.
"""

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import redis
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.evaluate import FrameworkEvaluator
from crowdtrain.assimilator.inputs import Refused, Result, read_result, replay_of, replay_reason, validation_set
from crowdtrain.assimilator.policy import Policy, apply_with_policy
from crowdtrain.assimilator.replica_vote import judge_replicas
from crowdtrain.assimilator.rules import Rule, make_rule
from crowdtrain.core.keys import snapshot_key
from crowdtrain.core.logs import ids
from crowdtrain.core.settings import Settings
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.core.tensors import Params, sha256
from crowdtrain.server.ledger import duplicates, merges, result_records, snapshot_list
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.epochs import Evaluator, close_epoch_if_complete, fail_job
from crowdtrain.server.paramstore import merging, store
from crowdtrain.server.paramstore.steps import QueuedResult, Step, Taken
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
    queued = "queued"  # left to the process that merges the job's results (crowdtrain.assimilator.merge_pass)


@dataclass(frozen=True)
class MergeResult:
    """What one call of `assimilate` did."""

    outcome: Outcome
    version: int | None = None  # the W_s version that holds the result (merged, already merged)
    reason: str = ""  # why it was refused or failed


@dataclass(frozen=True)
class Decided:
    """A result whose outcome was decided before any merge (refused, superseded, or judged by a
    replica vote: validated, refused, awaiting replicas); nothing more is recorded for it here.
    `also_merge`: the canonical replica the vote chose, another assignment, to merge in the same pass."""

    result: MergeResult
    also_merge: int | None = None


@dataclass(frozen=True)
class MergeServices:
    """What a merge works with: the ledger, object storage, Redis (W_s), the snapshots to keep, and
    what scores W_s on a job's validation set (this process's one evaluator)."""

    db: sessionmaker[Session]
    storage: Storage
    r: redis.Redis
    snapshots_kept: int
    evaluator: Evaluator = field(default_factory=FrameworkEvaluator)

    @classmethod
    def from_settings(cls, settings: Settings) -> "MergeServices":
        return cls(
            session_factory(settings.resolved_database_url),
            open_storage(settings.resolved_storage_url, settings.s3_endpoint_url),
            store.connect(settings.redis_url),
            settings.snapshots_kept,
            FrameworkEvaluator(),
        )


def assimilate(svc: MergeServices, assignment_id: int, received_at: float | None = None) -> MergeResult:
    """Merge the uploaded result of `assignment_id` into W_s and record what happened.

    Merged exactly once; may be delivered twice: a second call for the same assignment merges
    nothing again and completes the recording an earlier one left unfinished. A refused result
    (stale, too large, malformed, or its job no longer running) leaves W_s unchanged. Raises only
    TRANSIENT errors, after which the caller runs it again; any other failure ends the assignment
    (and, when the job is at fault, the job) and is returned as `failed`.
    """
    return assimilate_many(svc, [(assignment_id, received_at)])[0]


def assimilate_many(svc: MergeServices, queued: Sequence[tuple[int, float | None]]) -> list[MergeResult]:
    """Merge the uploaded results of `queued` (assignment id, received at), all of one job, in order,
    into W_s read once and written once, and record what happened to each: what `assimilate` does
    for one, with the same guarantee. A failure that is not TRANSIENT sends each result through
    `assimilate` alone, so that it ends only the result (or the job) at fault.
    """
    try:
        return _assimilate_many(svc, queued)
    except TRANSIENT:
        raise
    except Exception as exc:
        if len(queued) == 1:
            return [_failed(svc, queued[0][0], exc)]
        return [assimilate(svc, assignment_id, received_at) for assignment_id, received_at in queued]


def _assimilate_many(svc: MergeServices, queued: Sequence[tuple[int, float | None]]) -> list[MergeResult]:
    results: dict[int, MergeResult] = {}
    recorded: list[tuple[merges.PendingMerge, int]] = []  # W_s holds each at that version
    to_merge: dict[int, tuple[merges.PendingMerge, QueuedResult]] = {}  # in the order they are merged
    pendings = merges.pending_merges(svc.db, [assignment_id for assignment_id, _ in queued])
    # The queued results, then the canonical replicas their votes chose (another result of one of
    # their workunits, read afresh): all are merged in the one pass below.
    work = deque(queued)
    while work:
        assignment_id, received_at = work.popleft()
        pending = pendings[assignment_id]
        if assignment_id in to_merge:
            continue
        if pending is None:
            results[assignment_id] = MergeResult(Outcome.nothing_to_merge)
            continue
        if not store.has_server_model(svc.r, pending.job_id):
            merges.restore_server_model(svc.db, svc.storage, svc.r, pending.job_id)
        version = merging.merged_version(svc.r, pending.job_id, assignment_id)
        if pending.already_merged or version is not None:
            # W_s restored from an older snapshot may have lost the merge the ledger recorded: v0 stands in.
            results[assignment_id] = MergeResult(Outcome.already_merged, version or 0)
            recorded.append((pending, version or 0))
            continue
        prepared = _prepare(svc, pending, received_at)
        if isinstance(prepared, QueuedResult):
            to_merge[assignment_id] = (pending, prepared)
            continue
        results[assignment_id] = prepared.result
        if prepared.also_merge is not None:
            pendings[prepared.also_merge] = merges.pending_merge(svc.db, prepared.also_merge)
            work.append((prepared.also_merge, received_at))
    merging_now = list(to_merge.values())
    for (pending, _), result in zip(merging_now, _merge(svc, merging_now), strict=True):
        results[pending.assignment_id] = result
        if result.version is not None:
            recorded.append((pending, result.version))
    record_merged(svc, recorded)
    return [results[assignment_id] for assignment_id, _ in queued]


def _prepare(svc: MergeServices, p: merges.PendingMerge, received_at: float | None) -> QueuedResult | Decided:
    """A result that no delivery has merged yet, read and ready to merge; or what was decided instead:
    refused, superseded when another assignment of its workunit was merged first, or judged by a
    replica vote."""
    try:
        return _read_and_judge(svc, p, received_at)
    except Refused as exc:
        return Decided(_refuse(svc, p.assignment_id, exc))
    except Superseded as exc:
        return Decided(_supersede(svc, p.assignment_id, exc))


def _read_and_judge(svc: MergeServices, p: merges.PendingMerge, received_at: float | None) -> QueuedResult | Decided:
    """`_prepare`'s work; raises Refused or Superseded for `_prepare` to record."""
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
        decided = _vote(svc, p)
        if decided is not None:
            return decided
    elif replayed is not None:
        raise Refused(replay_reason(replayed), charge=True)
    if result is None:
        assert unreadable is not None
        raise unreadable
    assimilation = p.spec["assimilation"]
    step = _guarded(p, make_rule(assimilation), Policy.from_spec(assimilation), result)
    return QueuedResult(p.assignment_id, step, received_at, result.norm, p.workunit_id)


def _merge(svc: MergeServices, to_merge: Sequence[tuple[merges.PendingMerge, QueuedResult]]) -> list[MergeResult]:
    """Merge the prepared results in one pass (merging.merge_batch), refusing or superseding those
    it did not merge; each one's outcome, in order."""
    if not to_merge:
        return []
    first = to_merge[0][0]
    assert all(p.job_id == first.job_id for p, _ in to_merge), "a pass merges one job's results"
    initial_state = make_rule(first.spec["assimilation"]).initial_state
    try:
        takings = merging.merge_batch(svc.r, first.job_id, [q for _, q in to_merge], initial_state)
    except merging.MergesClosed:
        closed = Refused("job is no longer running", charge=False)
        return [_refuse(svc, p.assignment_id, closed) for p, _ in to_merge]
    results = []
    for (_, queued), taking in zip(to_merge, takings, strict=True):
        if taking.taken is Taken.refused:
            results.append(_refuse(svc, taking.assignment_id, Refused(taking.reason, charge=True)))
        elif taking.taken is Taken.superseded:
            results.append(_supersede(svc, taking.assignment_id, Superseded(taking.winner)))
        elif taking.taken is Taken.already_merged:
            results.append(MergeResult(Outcome.already_merged, taking.version))
        else:
            telemetry.count(svc.r, "merges")
            if queued.received_at:
                telemetry.observe_merge_latency(svc.r, time.time() - queued.received_at)
            results.append(MergeResult(Outcome.merged, taking.version))
    return results


def _vote(svc: MergeServices, p: merges.PendingMerge) -> Decided | None:
    """The replica vote (crowdtrain.assimilator.replica_vote) for a replicated result: None when `p`
    is the canonical replica, for the caller to merge it; else this assignment's outcome, with the
    canonical replica to merge when the vote chose another (its own merge ended while it waited)."""
    vote = judge_replicas(svc.db, svc.storage, svc.r, svc.evaluator, p)
    if vote.canonical == p.assignment_id:
        return None
    if vote.refused is not None:
        outcome = MergeResult(Outcome.refused, reason=vote.refused)
    elif vote.canonical is not None:
        outcome = MergeResult(Outcome.validated, reason=f"agrees with replica {vote.canonical}")
    else:
        outcome = MergeResult(Outcome.awaiting_replicas)
    return Decided(outcome, also_merge=vote.canonical)


def _guarded(p: merges.PendingMerge, rule: Rule, policy: Policy, result: Result) -> Step:
    """The rule wrapped in the policy every rule obeys: refuse stale results and too large updates,
    clip. Run inside the merge transaction, perhaps more than once: only the staleness, which
    depends on the version W_s has then, and the recent norms are taken anew each time."""

    def step(server: Params, state: Params, version: int, recent: Sequence[float]) -> str | None:
        now = replace(result.update, staleness=version - p.base_version)
        return apply_with_policy(policy, rule, server, state, now, version, result.norm, recent, result.base_norm)

    return step


def _refuse(svc: MergeServices, assignment_id: int, refused: Refused) -> MergeResult:
    """Reject the result: its workunit is ready again (or failed, when charged up to max_errors)."""
    if merges.reject_result(svc.db, svc.storage, svc.r, assignment_id, refused.reason, refused.charge, svc.evaluator):
        telemetry.count(svc.r, "rejections")
    return MergeResult(Outcome.refused, reason=refused.reason)


def _supersede(svc: MergeServices, assignment_id: int, superseded: Superseded) -> MergeResult:
    """End the result `superseded` and delete its upload: W_s holds its workunit from another assignment."""
    upload_key = duplicates.supersede_result(svc.db, assignment_id, superseded.winner_id)
    if upload_key:
        svc.storage.delete(upload_key)
    return MergeResult(Outcome.superseded, reason=str(superseded))


def record_merged(svc: MergeServices, merged: Sequence[tuple[merges.PendingMerge, int]]) -> None:
    """Record results of one job that W_s holds, each at its version. W_s is evaluated once, when one
    of those versions is due (`eval_every`), and its figure recorded for the last result of each
    epoch here: a pass that fell behind evaluates the version it wrote, not every merge. The metric
    is recorded before the workunits are marked done: when an epoch's last workunit is done, its
    merges have their validation figures."""
    if not merged:
        return
    last = merged[-1][0]
    sched = last.spec["scheduling"]
    # One the ledger shows merged had its turn to be measured before it was marked merged.
    unrecorded = [(p, version) for p, version in merged if not p.already_merged]
    if any(version % sched["eval_every"] == 0 for _, version in unrecorded):
        _record_metrics(svc, list({p.epoch: p for p, _ in unrecorded}.values()))
        _stop_if_diverged(svc, last)
    _publish_snapshot_if_due(svc, last.job_id, sched, max(version for _, version in merged))
    superseded = merges.record_merges(svc.db, [(p.assignment_id, version) for p, version in merged])
    for key in [*(p.upload_key for p, _ in merged), *superseded]:
        svc.storage.delete(key)
    for p, _ in merged:
        result_records.forget_checked_upload(svc.r, p.job_id, p.upload_key)
    for epoch in sorted({p.epoch for p, _ in merged}):
        close_epoch_if_complete(svc.db, svc.storage, svc.r, last.job_id, epoch, svc.evaluator)


def _record_metrics(svc: MergeServices, measured: Sequence[merges.PendingMerge]) -> None:
    """Evaluate W_s on the job's validation set once, and record it for each of `measured` that has no
    figure yet; JobBroken when that cannot work."""
    unmeasured = [(p, merges.unmeasured_validation_key(svc.db, p.job_id, p.assignment_id)) for p in measured]
    unmeasured = [(p, key) for p, key in unmeasured if key is not None]
    if not unmeasured:
        return
    p, validation_key = unmeasured[-1]
    assert validation_key is not None
    version, params = store.read(svc.r, p.job_id)
    try:
        x, y = validation_set(svc.storage, validation_key)
        loss, acc = svc.evaluator.evaluate(p.job_id, p.model_config, params, x, y)
    except TRANSIENT:
        raise
    except Exception as exc:
        raise JobBroken(
            f"evaluating W_s v{version} on the job's validation set failed: {type(exc).__name__}: {exc}"
        ) from exc
    for p, _ in unmeasured:
        merges.record_metric(svc.db, p.job_id, p.epoch, p.assignment_id, version, loss, acc)
    log.info("job %s: W_s v%d validation accuracy %.4f loss %.4f (epoch %d)", p.job_id, version, acc, loss, p.epoch)


def _stop_if_diverged(svc: MergeServices, p: merges.PendingMerge) -> None:
    """Fail the job, saying why, when its validation losses show W_s diverging (Policy.divergence):
    merging more would make it worse, and the operator should lower the rule's step."""
    policy = Policy.from_spec(p.spec["assimilation"])
    best, latest = merges.validation_losses(svc.db, p.job_id, policy.divergence_patience)
    why = policy.divergence(best, latest)
    if why is None:
        return
    message = (
        f"W_s diverged: {why}. Merging more would make it worse: lower the rule's step "
        "(assimilation.server_lr, or a higher alpha for vc-asgd) or the clients' learning rate; "
        "assimilation.divergence_factor sets this bound"
    )
    if fail_job(svc.db, svc.storage, svc.r, p.job_id, message, svc.evaluator):
        log.warning("job %s failed: %s", p.job_id, message, extra=ids(job_id=p.job_id))


def _publish_snapshot_if_due(svc: MergeServices, job_id: int, sched: dict[str, Any], version: int) -> None:
    """Publish W_s for dispatch at most once per `snapshot_every_merges` merges or seconds."""
    last_v, age = merges.last_snapshot(svc.db, job_id)
    due = version - last_v >= sched["snapshot_every_merges"] or (
        age is not None and age >= sched["snapshot_every_seconds"]
    )
    if version <= last_v or not due:
        return
    current, blob = store.read_blob(svc.r, job_id)
    key = snapshot_key(job_id, current)
    svc.storage.put(key, blob)
    if not merges.record_snapshot(svc.db, job_id, current, key, sha256(blob)):
        return
    # Only the newest few snapshots are kept, and none that an unmerged assignment started from.
    expired = snapshot_list.note_snapshot(svc.r, job_id, current, svc.snapshots_kept)
    if not expired:
        return
    in_use = merges.snapshots_in_use(svc.db, job_id, expired)
    for old in expired:
        if old in in_use:
            snapshot_list.keep_snapshot(svc.r, job_id, old)
        else:
            svc.storage.delete(snapshot_key(job_id, old))


def _failed(svc: MergeServices, assignment_id: int, exc: Exception) -> MergeResult:
    """A merge failed for a reason that retrying will not remove: end the assignment, so that nothing
    queues it again, and fail the job when the cause is its own (crowdtrain.server.ledger.merges)."""
    cause = str(exc) if isinstance(exc, JobBroken) else f"{type(exc).__name__}: {exc}"
    log.error(
        "assignment %s: merge failed: %s", assignment_id, cause, exc_info=exc, extra=ids(assignment_id=assignment_id)
    )
    if merges.end_failed_merge(
        svc.db, svc.storage, svc.r, assignment_id, cause, isinstance(exc, JobBroken), svc.evaluator
    ):
        telemetry.count(svc.r, "rejections")
    return MergeResult(Outcome.failed, reason=cause)
