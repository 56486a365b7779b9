"""Service layer of the DeDLOC mode, a round's bookkeeping: what a peer's progress report does and
what it is told to do next, a member's outcome of its reduction, and the torch.distributed Store of
its all-reduce group. The parts of a round and their total are in crowdtrain.server.services.dedloc_relay,
the job's side (opening, joining, states) in crowdtrain.server.services.dedloc_jobs, the round's phases
themselves in crowdtrain.server.services.dedloc; the routes only move data in and out."""

import base64
import logging
import threading
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any, cast

import redis
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import dedloc as math
from crowdtrain.core import keys
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.core.refusals import RefusalKind
from crowdtrain.core.schemas_dedloc import (
    Outcome,
    PeerAction,
    Progress,
    ProgressReply,
    RoundPlanOut,
    StoreOp,
    StoreReply,
)
from crowdtrain.core.states import JobStatus
from crowdtrain.server.ledger.models import Job
from crowdtrain.server.services import dedloc, dedloc_claims, dedloc_document, dedloc_peers, dedloc_states
from crowdtrain.server.services.clock import now_or_wall
from crowdtrain.server.services.dedloc_document import Round, RoundGone, RoundPhase
from crowdtrain.server.services.dedloc_jobs import DedlocProblem, JobView, job_view, joined_round
from crowdtrain.server.services.dedloc_peers import NotAMember

log = logging.getLogger(__name__)


def _plan_for(rnd: Round, peer_id: str, spec: DedlocSpec) -> RoundPlanOut:
    group = dedloc.group_of(rnd, peer_id)
    members = rnd.groups[group] if group is not None else []
    # A round written before sessions existed has none: its groups rendezvous for that round only.
    session = rnd.sessions[group] if group is not None and group < len(rnd.sessions) else None
    return RoundPlanOut(
        step=rnd.step,
        attempt=rnd.attempt,
        members=rnd.members,
        examples=rnd.examples,
        total=rnd.total,
        relayed=group is None,
        group=group,
        group_members=members,
        rank=members.index(peer_id) if group is not None else None,
        session=session,
        new_session=session is None or math.new_session(session, rnd.tag),
        needs_combining=rnd.plan.needs_combining,
        parts=rnd.plan.parts,
        averaging_timeout=spec.averaging_timeout,
    )


# Answers that only tell the peer to go on waiting for the others: a report that asks to (`Progress.wait`)
# is held open while its answer would be one of these, and answered as soon as the round moves.
WAITING = frozenset({PeerAction.matchmaking, PeerAction.wait})
HELD_REPORTS = 8  # reports one scheduler process holds open at once; beyond them the answer comes at once
RECHECK_S = 0.25  # a held report is answered anew at least this often (deadlines pass without a message)
_held = threading.BoundedSemaphore(HELD_REPORTS)


def progress(
    db: sessionmaker[Session], r: redis.Redis, job_id: int, host_id: int, req: Progress, now: float | None = None
) -> ProgressReply:
    """A peer's report of its accumulated examples at `now` (the clock's); the answer says what it does next.

    With `req.wait` (the peer has nothing to do until the others move), a report whose answer would only
    say to go on waiting (`still_waiting`) is held open, up to `req.wait` seconds, and answered anew
    each time the round's document changes (its channel, keys.dedloc_changed) and at least every
    RECHECK_S: a round's members hear that its step closed, that it starts, or that it was committed,
    within a message's time of the report that made it so, not a poll interval later. A held report
    holds one of the process's request threads, so at most HELD_REPORTS are held at once; the others
    are answered at once, and their peers ask again as they would without."""
    now = now_or_wall(now)
    first = _progress_once(db, r, job_id, host_id, req, now)
    if req.wait <= 0 or not still_waiting(first, first) or not _held.acquire(blocking=False):
        return first
    began = time.monotonic()
    try:
        with closing(r.pubsub()) as changes:
            changes.subscribe(keys.dedloc_changed(job_id))
            changes.get_message(timeout=RECHECK_S)  # the subscription confirmed: no change can slip by now
            while True:
                waited = time.monotonic() - began
                reply = _progress_once(db, r, job_id, host_id, req, now + waited)
                if not still_waiting(reply, first) or waited >= req.wait:
                    return reply
                if changes.get_message(timeout=min(RECHECK_S, req.wait - waited)) is not None:
                    while changes.get_message(timeout=0) is not None:  # one answer for a burst of changes
                        pass
    finally:
        _held.release()


def still_waiting(reply: ProgressReply, first: ProgressReply) -> bool:
    """Whether `reply`, to a peer that asked to wait and was first answered `first`, tells it nothing
    new: it is not asked to upload its state, and it is to wait in matchmaking or for the others'
    outcomes (WAITING), or, as first, to accumulate a batch the others fill, with as many peers and
    no fewer examples accumulated (fewer, or another number of peers, may give it examples to compute)."""
    if reply.upload_state:
        return False
    if reply.action in WAITING:
        return True
    return (
        reply.action == first.action == PeerAction.accumulate
        and reply.peers == first.peers
        and reply.accumulated >= first.accumulated
    )


def _progress_once(
    db: sessionmaker[Session], r: redis.Redis, job_id: int, host_id: int, req: Progress, now: float
) -> ProgressReply:
    view = job_view(db, job_id)
    with dedloc_document.lock(r, job_id):
        try:
            dedloc_peers.touch(r, job_id, req.peer_id, host_id, now)
        except NotAMember as exc:
            raise DedlocProblem(RefusalKind.forbidden, str(exc)) from None
        rnd = dedloc_document.load(r, job_id)
        if rnd is None:
            raise DedlocProblem(RefusalKind.conflict, f"job {job_id} is still being prepared")
        dedloc_states.rewind_orphaned(r, job_id, view.spec, rnd, now)
        if req.params_digest and req.step >= 0:
            r.hset(keys.dedloc_digests(job_id, req.step), req.peer_id, req.params_digest)
            r.expire(keys.dedloc_digests(job_id, req.step), 24 * 3600)
        reply = _next_action(r, view, rnd, req, now)
        if reply.action != PeerAction.apply and req.step == rnd.step:
            reply.upload_state = dedloc_states.asked_to_upload(
                r, job_id, view.spec, rnd, req.peer_id, view.max_steps, now
            )
        dedloc_document.save(r, job_id, rnd)
    return reply


def _next_action(r: redis.Redis, view: JobView, rnd: Round, req: Progress, now: float) -> ProgressReply:
    def answer(action: PeerAction, **kw: Any) -> ProgressReply:
        return ProgressReply(action=action, step=rnd.step, state_step=rnd.state_step, **kw)

    # A committed step is applied by each of its members, even when it was the job's last.
    if _committed_with(r, view, rnd, req):
        # The state after it is uploaded once its members have reported holding the same parameters
        # (`upload_state` in a later answer: crowdtrain.server.services.dedloc_states).
        return answer(PeerAction.apply)
    if rnd.finished or not view.running:
        return answer(PeerAction.stop, message="the job has finished")
    if req.step != rnd.step:
        return answer(PeerAction.resync, message=f"the collaboration is at step {rnd.step}")
    dedloc.advance(r, view.id, rnd, view.spec, view.max_steps, now)
    if rnd.phase == RoundPhase.accumulating or req.peer_id not in rnd.candidates + rnd.members:
        _note_claim(r, view, rnd, req, now)
    if rnd.phase == RoundPhase.matchmaking:
        _note_ready(r, view, rnd, req, now)
    if rnd.phase == RoundPhase.reducing and req.peer_id in rnd.members:
        if req.peer_id in rnd.done:
            return answer(PeerAction.wait)
        return answer(PeerAction.reduce, round=_plan_for(rnd, req.peer_id, view.spec))
    if rnd.phase == RoundPhase.matchmaking and req.peer_id in rnd.ready:
        return answer(PeerAction.matchmaking)
    # What the others are told counts no excluded peer, and each claim only up to its bound.
    bounds = dedloc.claim_bounds(r, view.id, rnd, view.spec, now)
    reported = dedloc_claims.progress(r, view.id, rnd.step, bounds)
    return answer(PeerAction.accumulate, accumulated=sum(reported.values()), peers=max(1, len(bounds)))


def _committed_with(r: redis.Redis, view: JobView, rnd: Round, req: Progress) -> bool:
    """Whether the peer reports an attempt of a step before the running one that was committed with
    it as a member."""
    if not 0 <= req.step < rnd.step or req.attempt is None:
        return False
    commit = dedloc.commit_of(r, view.id, req.step)
    return commit is not None and commit["attempt"] == req.attempt and req.peer_id in commit["members"]


def _note_claim(r: redis.Redis, view: JobView, rnd: Round, req: Progress, now: float) -> None:
    """Record the examples the peer claims for the running step (and when it first claimed any)."""
    r.hset(keys.dedloc_progress(view.id, rnd.step), req.peer_id, req.examples)
    if req.examples > 0:
        rnd.claimed_at.setdefault(req.peer_id, now)
    dedloc.advance(r, view.id, rnd, view.spec, view.max_steps, now)


def _note_ready(r: redis.Redis, view: JobView, rnd: Round, req: Progress, now: float) -> None:
    """While matchmaking: the peer is ready with its examples, unless it claims more than its bound
    (not ready until time catches up with its claim: a fake claim never does). An excluded peer
    (dedloc.excluded) is never a member again."""
    bound = dedloc.claim_bounds(r, view.id, rnd, view.spec, now).get(req.peer_id, 0)
    if req.examples > bound:
        log.info(
            "job %s: peer %s claims %d examples, beyond its bound %d: not ready",
            view.id,
            req.peer_id,
            req.examples,
            bound,
        )
        return
    if req.examples <= 0:
        return
    if req.peer_id not in rnd.candidates:
        rnd.candidates.append(req.peer_id)  # synced and accumulating: welcome while members are gathered
    rnd.ready[req.peer_id] = req.examples
    rnd.ready_at.setdefault(req.peer_id, now)
    dedloc.advance(r, view.id, rnd, view.spec, view.max_steps, now)


def report(
    db: sessionmaker[Session],
    r: redis.Redis,
    job_id: int,
    host_id: int,
    step: int,
    attempt: int,
    peer_id: str,
    ok: bool,
    result_digest: str,
    message: str,
    now: float | None = None,
) -> Outcome:
    """A member's outcome of its reduction at `now` (the clock's): done (with the digest of its
    result) or failed. A failure reported past the averaging deadline finds the attempt already
    aborted for the members that never answered (a member whose collective timed out waiting
    for an absent peer is not to blame)."""
    now = now_or_wall(now)
    view = job_view(db, job_id)
    with dedloc_document.lock(r, job_id):
        try:
            dedloc_peers.touch(r, job_id, peer_id, host_id, now)
        except NotAMember as exc:
            raise DedlocProblem(RefusalKind.forbidden, str(exc)) from None
        rnd = joined_round(r, job_id)
        try:
            if ok:
                commit = dedloc.record_done(r, job_id, rnd, view.spec, peer_id, step, attempt, result_digest, now)
            else:
                dedloc.advance(r, job_id, rnd, view.spec, view.max_steps, now)
                dedloc.check_member(rnd, peer_id, step, attempt)
                dedloc.abort(r, job_id, rnd, view.spec, f"{peer_id} failed: {message}", [peer_id], now)
                commit = None
        except RoundGone as exc:
            raise DedlocProblem(RefusalKind.conflict, str(exc)) from None
        except NotAMember as exc:
            raise DedlocProblem(RefusalKind.forbidden, str(exc)) from None
        dedloc_document.save(r, job_id, rnd)
    if commit is not None:
        with db.begin() as s:
            job = s.get_one(Job, job_id)
            # A step committed after the job ended (its members had not learnt it yet) is no version
            # of the job: the finished job's version is that of the state it was judged and exported at.
            if job.status == JobStatus.running.value:
                job.param_version = max(job.param_version, step + 1)
        return Outcome.committed
    return Outcome.recorded if ok else Outcome.aborted


def running_member(
    r: redis.Redis, job_id: int, host_id: int, peer_id: str, step: int, attempt: int, now: float
) -> Round:
    """The running round, once the caller is checked to be a member of (step, attempt) at `now`."""
    try:
        dedloc_peers.touch(r, job_id, peer_id, host_id, now)
        rnd = joined_round(r, job_id)
        dedloc.check_member(rnd, peer_id, step, attempt)
        dedloc_claims.attend(r, job_id, step, attempt, peer_id, dedloc.ARTIFACT_TTL)
        return rnd
    except RoundGone as exc:
        raise DedlocProblem(RefusalKind.conflict, str(exc)) from None
    except NotAMember as exc:
        raise DedlocProblem(RefusalKind.forbidden, str(exc)) from None


def _b64(v: bytes | None) -> str | None:
    return None if v is None else base64.b64encode(v).decode()


def store_op(
    r: redis.Redis, job_id: int, host_id: int, step: int, attempt: int, op: str, req: StoreOp, now: float
) -> StoreReply:
    """One call, at `now`, of the torch.distributed Store of the caller's all-reduce group in (step, attempt).

    Keys live under a prefix per job, step, attempt and group, expire after an hour, and can be
    touched only by that group's members while the attempt runs.
    """
    rnd = running_member(r, job_id, host_id, req.peer_id, step, attempt, now)
    group = dedloc.group_of(rnd, req.peer_id)
    if group is None:
        raise DedlocProblem(RefusalKind.forbidden, f"peer {req.peer_id} is relayed: it has no all-reduce group")
    handle = _STORE_OPS.get(op)
    if handle is None:
        raise DedlocProblem(RefusalKind.not_found, f"unknown store operation {op!r}")
    return handle(r, keys.dedloc_store(job_id, step, attempt, group), req)


def _value(req: StoreOp) -> bytes:
    return b"" if req.value is None else base64.b64decode(req.value)


def _store_set(r: redis.Redis, prefix: str, req: StoreOp) -> StoreReply:
    key = prefix + req.key
    r.set(key, _value(req), ex=dedloc.ARTIFACT_TTL)
    return StoreReply()


def _store_get(r: redis.Redis, prefix: str, req: StoreOp) -> StoreReply:
    key = prefix + req.key
    got = _wait_for(lambda: r.get(key), req.wait)
    return StoreReply(value=_b64(got), found=got is not None)


def _store_add(r: redis.Redis, prefix: str, req: StoreOp) -> StoreReply:
    key = prefix + req.key
    try:
        n = r.incrby(key, req.amount)
    except redis.ResponseError as exc:  # the key holds other bytes, or the sum leaves 64 bits
        raise DedlocProblem(
            RefusalKind.conflict, f"store key {req.key!r} holds no counter that can add {req.amount}: {exc}"
        ) from None
    r.expire(key, dedloc.ARTIFACT_TTL)
    return StoreReply(number=n)


def _store_check(r: redis.Redis, prefix: str, req: StoreOp) -> StoreReply:
    found = _wait_for(lambda: all(r.exists(prefix + k) for k in req.keys) or None, req.wait)
    return StoreReply(found=bool(found))


def _store_compare_set(r: redis.Redis, prefix: str, req: StoreOp) -> StoreReply:
    key = prefix + req.key
    expected = None if req.expected is None else base64.b64decode(req.expected)
    value = _value(req)
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                # redis-py types replies `bytes | str`; ours are bytes (no `decode_responses`).
                current = cast(bytes | None, pipe.get(key))
                pipe.multi()
                if (current is None and not expected) or current == expected:
                    pipe.set(key, value, ex=dedloc.ARTIFACT_TTL)
                    pipe.execute()
                    return StoreReply(value=_b64(value))
                pipe.reset()
                return StoreReply(value=_b64(current if current is not None else expected))
            except redis.WatchError:
                continue


def _store_delete(r: redis.Redis, prefix: str, req: StoreOp) -> StoreReply:
    key = prefix + req.key
    return StoreReply(found=bool(r.delete(key)))


# The operations of torch.distributed's Store, each given the group's key prefix and the request.
_STORE_OPS: dict[str, Callable[[redis.Redis, str, StoreOp], StoreReply]] = {
    "set": _store_set,
    "get": _store_get,
    "add": _store_add,
    "check": _store_check,
    "compare_set": _store_compare_set,
    "delete": _store_delete,
}


def _wait_for(fetch, seconds: float):
    end = time.monotonic() + seconds
    while True:
        got = fetch()
        if got is not None or time.monotonic() >= end:
            return got
        time.sleep(0.005)
