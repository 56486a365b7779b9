"""Merging uploaded results into W_s, one or a job's queue at a time, and their outcomes into the ledger.

`assimilate_many` merges results of one job in one pass: it reads each upload once from where the
scheduler stored it (crowdtrain.assimilator.inputs: a weights upload the scheduler checked and
hashed is neither checked nor hashed again), refuses a replayed result, has a replicated one voted
on (crowdtrain.assimilator.replica_vote; the canonical replica a vote chooses joins the pass),
merges them in order with the job's rule under the policy every rule obeys (staleness bound,
update-norm bound, clipping: crowdtrain.assimilator.policy) into W_s read once and written once, records
each outcome, evaluates W_s when due (once per pass, not once per merge), publishes a snapshot when
due, and closes the epochs that are complete (crowdtrain.assimilator.recording.record_merged).
`assimilate` is a pass of one result.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from crowdtrain.assimilator.inputs import Refused, Result, read_result, replay_of, replay_reason
from crowdtrain.assimilator.merge_services import TRANSIENT, JobBroken, MergeServices
from crowdtrain.assimilator.policy import Policy, apply_with_policy
from crowdtrain.assimilator.recording import record_merged
from crowdtrain.assimilator.replica_vote import judge_replicas
from crowdtrain.assimilator.rules import Rule, make_rule, reads_validation
from crowdtrain.core import merge_stages
from crowdtrain.core.assimilationspec import assimilation_of
from crowdtrain.core.logs import ids
from crowdtrain.core.merge_stages import Stamps
from crowdtrain.core.tensors import Params
from crowdtrain.server.ledger import duplicates, merges
from crowdtrain.server.paramstore import merging, store
from crowdtrain.server.paramstore.steps import QueuedResult, Step, Taken
from crowdtrain.server.services import telemetry

log = logging.getLogger(__name__)

# What callers use, the merge's services and its transient failures (crowdtrain.assimilator.merge_services) included.
__all__ = ["TRANSIENT", "MergeResult", "MergeServices", "Outcome", "assimilate", "assimilate_many"]


class Superseded(Exception):
    """Another assignment of the same workunit (a straggler and its duplicate) was merged first:
    this result is not merged, and its assignment ends `superseded` (crowdtrain.server.ledger.duplicates)."""

    def __init__(self, winner_id: int | None):
        super().__init__(
            "workunit already merged from " + ("another assignment" if winner_id is None else f"assignment {winner_id}")
        )
        self.winner_id = winner_id


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
class JobTerms:
    """What one pass reads once for a job: its rule and policy, and, for a rule that follows it, the
    job's latest evaluation (merges.latest_validation)."""

    rule: Rule
    policy: Policy
    validation: tuple[int, float] | None


def _job_terms(svc: MergeServices, p: merges.PendingMerge) -> JobTerms:
    assimilation = assimilation_of(p.spec["assimilation"])  # read once, for the rule and the policy
    validation = merges.latest_validation(svc.db, p.job_id) if reads_validation(assimilation) else None
    return JobTerms(make_rule(assimilation), Policy.from_spec(assimilation), validation)


def assimilate(svc: MergeServices, assignment_id: int, stamps: Stamps | None = None) -> MergeResult:
    """Merge the uploaded result of `assignment_id` into W_s and record what happened.

    Merged exactly once; may be delivered twice: a second call for the same assignment merges
    nothing again and completes the recording an earlier one left unfinished. A refused result
    (stale, too large, malformed, or its job no longer running) leaves W_s unchanged. Raises only
    TRANSIENT errors, after which the caller runs it again; any other failure ends the assignment
    (and, when the job is at fault, the job) and is returned as `failed`.
    """
    return assimilate_many(svc, [(assignment_id, stamps)])[0]


def assimilate_many(
    svc: MergeServices,
    queued: Sequence[tuple[int, Stamps | None]],
    pendings: Mapping[int, merges.PendingMerge | None] | None = None,
) -> list[MergeResult]:
    """Merge the uploaded results of `queued` (assignment id, its merge stages so far), all of one job,
    in order, into W_s read once and written once, and record what happened to each: what `assimilate`
    does for one, with the same guarantee. `pendings`: their ledger records where the caller read them
    already (merges.ready_to_merge); the others are read here. A failure that is not TRANSIENT sends
    each result through `assimilate` alone, so that it ends only the result (or the job) at fault.
    """
    try:
        return _assimilate_many(svc, queued, pendings or {})
    except TRANSIENT:
        raise
    except Exception as exc:
        if len(queued) == 1:
            return [_failed(svc, queued[0][0], exc)]
        return [assimilate(svc, assignment_id, stamps) for assignment_id, stamps in queued]


def _assimilate_many(
    svc: MergeServices, queued: Sequence[tuple[int, Stamps | None]], known: Mapping[int, merges.PendingMerge | None]
) -> list[MergeResult]:
    results: dict[int, MergeResult] = {}
    recorded: list[tuple[merges.PendingMerge, int]] = []  # W_s holds each at that version
    to_merge: dict[int, tuple[merges.PendingMerge, QueuedResult]] = {}  # in the order they are merged
    pendings = dict(known)
    if unread := [assignment_id for assignment_id, _ in queued if assignment_id not in pendings]:
        pendings |= merges.pending_merges(svc.db, unread)
    terms: dict[int, JobTerms] = {}  # by job: read at the first result that needs them
    # The queued results, then the canonical replicas their votes chose (another result of one of
    # their workunits, read afresh): all are merged in the one pass below.
    work = deque(queued)
    while work:
        assignment_id, stamps = work.popleft()
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
        merge_stages.stamp(stamps, "found")
        prepared = _prepare(svc, pending, stamps, terms)
        if isinstance(prepared, QueuedResult):
            to_merge[assignment_id] = (pending, prepared)
            continue
        results[assignment_id] = prepared.result
        if prepared.also_merge is not None:
            pendings[prepared.also_merge] = merges.pending_merge(svc.db, prepared.also_merge)
            work.append((prepared.also_merge, None if stamps is None else dict(stamps)))
    merging_now = list(to_merge.values())
    for (pending, _), result in zip(merging_now, _merge(svc, merging_now, terms), strict=True):
        results[pending.assignment_id] = result
        if result.version is not None:
            recorded.append((pending, result.version))
    record_merged(svc, recorded)
    return [results[assignment_id] for assignment_id, _ in queued]


def _prepare(
    svc: MergeServices, p: merges.PendingMerge, stamps: Stamps | None, terms: dict[int, JobTerms]
) -> QueuedResult | Decided:
    """A result that no delivery has merged yet, read and ready to merge; or what was decided instead:
    refused, superseded when another assignment of its workunit was merged first, or judged by a
    replica vote."""
    try:
        return _read_and_judge(svc, p, stamps, terms)
    except Refused as exc:
        return Decided(_refuse(svc, p.assignment_id, exc))
    except Superseded as exc:
        return Decided(_supersede(svc, p.job_id, p.assignment_id, exc))


def _read_and_judge(
    svc: MergeServices, p: merges.PendingMerge, stamps: Stamps | None, terms: dict[int, JobTerms]
) -> QueuedResult | Decided:
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
        merge_stages.stamp(stamps, "read")
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
    if p.job_id not in terms:
        terms[p.job_id] = _job_terms(svc, p)
    job = terms[p.job_id]
    if job.validation is not None:
        result = replace(result, update=replace(result.update, validation=job.validation))
    step = _guarded(p, job.rule, job.policy, result)
    merge_stages.stamp(stamps, "judged")
    return QueuedResult(p.assignment_id, step, stamps, result.norm, p.workunit_id)


def _merge(
    svc: MergeServices, to_merge: Sequence[tuple[merges.PendingMerge, QueuedResult]], terms: dict[int, JobTerms]
) -> list[MergeResult]:
    """Merge the prepared results in one pass (merging.merge_batch), refusing or superseding those
    it did not merge; each one's outcome, in order."""
    if not to_merge:
        return []
    first = to_merge[0][0]
    assert all(p.job_id == first.job_id for p, _ in to_merge), "a pass merges one job's results"
    initial_state = terms[first.job_id].rule.initial_state
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
            results.append(_supersede(svc, first.job_id, taking.assignment_id, Superseded(taking.winner)))
        elif taking.taken is Taken.already_merged:
            results.append(MergeResult(Outcome.already_merged, taking.version))
        else:
            telemetry.count(svc.r, "merges")
            if queued.stamps is not None and "received" in queued.stamps:
                telemetry.observe_merge_latency(svc.r, time.time() - queued.stamps["received"])
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


def _supersede(svc: MergeServices, job_id: int, assignment_id: int, superseded: Superseded) -> MergeResult:
    """End the result `superseded` and delete its upload: W_s holds its workunit from another
    assignment. A winner the ledger shows rejected is recorded merged first: another process
    rejected it while a pass wrote it into W_s, and that pass died before its record. Else its
    workunit would be dealt again, and each new result of it superseded by the winner, without end
    (crowdtrain.server.ledger.merges.record_merges)."""
    winner = superseded.winner_id
    if winner is not None and merges.is_rejected(svc.db, winner):
        version = merging.merged_version(svc.r, job_id, winner)
        if version is not None:
            for key in merges.record_merges(svc.db, [(winner, version)]):
                svc.storage.delete(key)
    upload_key = duplicates.supersede_result(svc.db, assignment_id, superseded.winner_id)
    if upload_key:
        svc.storage.delete(upload_key)
    return MergeResult(Outcome.superseded, reason=str(superseded))


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
