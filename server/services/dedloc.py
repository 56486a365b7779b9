"""The rendezvous of the synchronous DeDLOC mode: step closing, rounds, commits, and strikes.

One job's round lives in Redis as one JSON document (`keys.dedloc_round`) that moves through

    accumulating --(live peers' reports reach target_batch_size)--> matchmaking (live peers within their bound)
    matchmaking  --(every awaited candidate ready, or matchmaking_timeout)--> reducing (members fixed)
    reducing     --(every member reported the same result digest)--> accumulating at step + 1 (committed)
    reducing     --(a member failed, or averaging_timeout)--> matchmaking, attempt + 1 (aborted)

Each group of a reduction has a process-group session (`sessions`). A group made of exactly the
members, in the same ranks, of a group of the last round keeps that group's session when the last
round committed (`kept`), so its members reuse their process group and skip the rendezvous; an
abort forgets every kept session, so the retry's groups rendezvous anew whoever failed.

Each transition is one read-modify-write under the job's Redis lock, so any number of scheduler
workers agree. Nothing moves on a timer: the deadlines are checked by every peer request, and live
peers poll at least every `report_interval` seconds; every function here takes the time `now`.

A peer's claimed examples count toward closing a step only up to a bound set by the fastest rate
shown and one global batch (`dedloc_claims`). Matchmaking waits on each candidate for one deadline
at most (`awaited`): one not ready by then is passed over until it next takes part in a round, and
a new peer that claimed examples of the step and never came ready is excluded at once (an
established peer after `spec.exclude_after` aborts in a row).

Guarantees: a step is committed at most once, with the members and result digest recorded in
`keys.dedloc_commits`; a peer applies a step only when it finds its own (step, attempt) there, so an
aborted attempt is applied by nobody and the collaboration never forks.

Which peers have joined and which are live is crowdtrain.server.services.dedloc_peers'.
"""

import json
import logging

import redis

from crowdtrain.core import dedloc, keys
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.server.services import dedloc_claims
from crowdtrain.server.services.dedloc_document import Round, RoundGone, RoundPhase
from crowdtrain.server.services.dedloc_peers import NotAMember, live_peers, peers

log = logging.getLogger(__name__)

ARTIFACT_TTL = 3600  # seconds rendezvous keys and round blobs are kept


def claim_bounds(r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, now: float) -> dict[str, int]:
    """The most examples each live, not excluded peer may claim for the running step at `now`."""
    shut_out = excluded(r, job_id, spec)
    live = {p: v for p, v in live_peers(r, job_id, spec, now).items() if p not in shut_out}
    return dedloc_claims.bounds(r, job_id, spec, {p: max(rnd.opened, v.joined) for p, v in live.items()}, now)


def accumulated(r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, now: float) -> dict[str, int]:
    """The examples live, not excluded peers claim for the running step, each up to its bound."""
    return dedloc_claims.progress(r, job_id, rnd.step, claim_bounds(r, job_id, rnd, spec, now))


def advance(r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, max_steps: int, now: float) -> Round:
    """Apply every transition that is due at `now` (step full, matchmaking over, averaging timed out)."""
    if rnd.finished:
        return rnd
    # Closing does not wait for the state upload of the last step: if its uploader died, the next
    # step's members upload a newer one, and newcomers sync to that.
    if rnd.phase == RoundPhase.accumulating and rnd.step < max_steps:
        _close_step(r, job_id, rnd, spec, now)
    if rnd.phase == RoundPhase.matchmaking:
        waited_on = awaited(r, job_id, rnd)
        if now > rnd.deadline or dedloc.matchmaking_over(rnd.candidates, rnd.ready, waited_on, spec.target_batch_size):
            _form_round(r, job_id, rnd, spec, waited_on, now)
    if rnd.phase == RoundPhase.reducing and now > rnd.deadline:
        missing = sorted(set(rnd.members) - set(rnd.done))
        abort(r, job_id, rnd, spec, f"averaging timed out waiting for {missing}", missing, now, timed_out=True)
    return rnd


def _close_step(r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, now: float) -> None:
    reported = accumulated(r, job_id, rnd, spec, now)
    if not dedloc.step_is_full(reported, spec.target_batch_size):
        return
    rnd.move(RoundPhase.matchmaking)
    rnd.attempt, rnd.ready, rnd.ready_at = 0, {}, {}
    # Every live peer is a candidate (up to matchmaking_timeout), also one still applying the last
    # step or loading the state: otherwise a fast peer could close steps alone and leave the others
    # chasing the collaboration. Some are waited on (`awaited`), none whose claim runs ahead of its
    # bound (it may still come ready if time catches up).
    bounds = claim_bounds(r, job_id, rnd, spec, now)
    rnd.candidates = sorted(set(bounds) - dedloc_claims.overclaimed(r, job_id, rnd.step, bounds))
    rnd.deadline = now + spec.matchmaking_timeout
    log.info(
        "job %s: step %d closed with %d examples from %s", job_id, rnd.step, sum(reported.values()), rnd.candidates
    )


def awaited(r: redis.Redis, job_id: int, rnd: Round) -> set[str]:
    """The candidates matchmaking waits on, up to its deadline: all of them (an over-claimer is no
    candidate) but those passed over. A volunteer that starts after the others is loading a state
    while the established peers may fill the next batch faster than it loads one: were it not
    awaited it could never complete a round. No peer costs the others more than one deadline in a
    row: one not ready by then is passed over until it next takes part in a round, and a new one
    that claimed examples of the step is excluded."""
    return set(rnd.candidates) - dedloc_claims.passed_over(r, job_id)


def _form_round(r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, waited_on: set[str], now: float) -> None:
    if now > rnd.deadline:
        late = waited_on - set(rnd.ready)
        no_shows = late & dedloc_claims.claimed(r, job_id, rnd.step) - dedloc_claims.established(r, job_id)
        if no_shows:
            log.warning("job %s: new peers %s claimed examples and never came ready: excluded", job_id, no_shows)
            dedloc_claims.shut_out(r, job_id, sorted(no_shows))
        if late - no_shows:
            log.info("job %s: peers %s were not ready by the deadline: passed over", job_id, sorted(late - no_shows))
            dedloc_claims.pass_over(r, job_id, sorted(late - no_shows))
    shut_out = excluded(r, job_id, spec)
    rnd.ready = {p: n for p, n in rnd.ready.items() if p not in shut_out}
    if not rnd.ready:
        log.warning("job %s: step %d attempt %d found no members; accumulating again", job_id, rnd.step, rnd.attempt)
        rnd.move(RoundPhase.accumulating)
        return
    relayed = {p for p, v in peers(r, job_id).items() if v.relayed}
    rnd.members = dedloc.choose_members(rnd.ready)
    dedloc_claims.take_part(r, job_id, rnd.members)
    rnd.examples = {p: rnd.ready[p] for p in rnd.members}
    plan = dedloc.plan_round(rnd.members, relayed, spec.max_group_size)
    rnd.groups, rnd.relayed, rnd.done = plan.groups, plan.relayed, {}
    rnd.formed += 1
    rnd.sessions = dedloc.group_sessions(plan.groups, rnd.kept, rnd.tag)
    rnd.move(RoundPhase.reducing)
    rnd.deadline = now + spec.averaging_timeout
    dropped = sorted(set(rnd.candidates) - set(rnd.members))
    log.info(
        "job %s: step %d attempt %d reduces %d examples: groups %s (sessions %s), relayed %s%s",
        job_id,
        rnd.step,
        rnd.attempt,
        rnd.total,
        rnd.groups,
        rnd.sessions,
        rnd.relayed,
        f", without {dropped}" if dropped else "",
    )


def abort(
    r: redis.Redis,
    job_id: int,
    rnd: Round,
    spec: DedlocSpec,
    reason: str,
    blamed: list[str],
    now: float,
    timed_out: bool = False,
) -> None:
    """Abort the running attempt for every member; its members but the excluded are the candidates of
    the retry. `blamed` are the members that caused it: one strike each (`excluded`), and when they
    `timed_out` a new peer among them that never took part is excluded at once."""
    shut_out = blame(r, job_id, spec, blamed, (rnd.step, rnd.attempt) if timed_out else None)
    r.hset(
        keys.dedloc_aborts(job_id),
        f"{rnd.step}:{rnd.attempt}",
        json.dumps({"members": rnd.members, "reason": reason[:500], "blamed": blamed, "at": now}),
    )
    log.warning(
        "job %s: step %d attempt %d aborted (%s); retrying without the peers that do not answer",
        job_id,
        rnd.step,
        rnd.attempt,
        reason,
    )
    rnd.candidates, rnd.ready, rnd.ready_at, rnd.done = [m for m in rnd.members if m not in shut_out], {}, {}, {}
    rnd.members, rnd.examples, rnd.groups, rnd.relayed = [], {}, [], []
    rnd.sessions, rnd.kept = [], {}  # a member may hold a broken process group: every group meets anew
    rnd.move(RoundPhase.matchmaking)
    rnd.attempt += 1
    rnd.deadline = now + spec.matchmaking_timeout


def record_done(
    r: redis.Redis,
    job_id: int,
    rnd: Round,
    spec: DedlocSpec,
    peer_id: str,
    step: int,
    attempt: int,
    result_digest: str,
    now: float,
) -> dict | None:
    """A member finished its reduction; returns the commit record when this completes the round."""
    if rnd.phase != RoundPhase.reducing or rnd.step != step or rnd.attempt != attempt:
        raise RoundGone(
            f"step {step} attempt {attempt} is not running (now step {rnd.step} attempt {rnd.attempt}, {rnd.phase})"
        )
    if peer_id not in rnd.members:
        raise NotAMember(f"peer {peer_id} is not a member of step {step} attempt {attempt}")
    rnd.done[peer_id] = result_digest
    if set(rnd.done) != set(rnd.members):
        return None
    if len(set(rnd.done.values())) != 1:
        # Members disagree on the averaged gradient: applying it would fork the collaboration.
        abort(r, job_id, rnd, spec, f"members' results differ: {rnd.done}", dedloc.dissenters(rnd.done), now)
        return None
    commit = {
        "step": step,
        "attempt": attempt,
        "members": rnd.members,
        "examples": rnd.examples,
        "digest": result_digest,
        "uploader": rnd.members[0],
        "at": now,
    }
    r.hset(keys.dedloc_commits(job_id), str(step), json.dumps(commit))
    _record_rates(r, job_id, rnd, now)
    r.hdel(keys.dedloc_strikes(job_id), *rnd.members)  # their runs of blamed aborts end
    log.info(
        "job %s: step %d committed (attempt %d, %d members, %d examples)",
        job_id,
        step,
        attempt,
        len(rnd.members),
        rnd.total,
    )
    _open_next_step(rnd, now)
    r.expire(keys.dedloc_progress(job_id, step), ARTIFACT_TTL)
    return commit


def _open_next_step(rnd: Round, now: float) -> None:
    """The running step is committed: its groups' sessions are kept, the next step accumulates from `now`."""
    rnd.kept = {dedloc.group_key(g): s for g, s in zip(rnd.groups, rnd.sessions, strict=True)}
    rnd.move(RoundPhase.accumulating)
    rnd.step, rnd.attempt = rnd.step + 1, 0
    rnd.candidates, rnd.ready, rnd.members, rnd.examples, rnd.groups, rnd.relayed, rnd.done = [], {}, [], {}, [], [], {}
    rnd.sessions, rnd.ready_at, rnd.claimed_at, rnd.opened = [], {}, {}, now


def _record_rates(r: redis.Redis, job_id: int, rnd: Round, now: float) -> None:
    """Each member of the committing round showed its examples in the seconds from its first claim for
    the step (else the step's opening, or its joining) to its being ready (else `now`). From the first
    claim: a new peer's downloads and a member's wait for the last step's state are not computing time."""
    joined = peers(r, job_id)
    seconds = {}
    for p in rnd.examples:
        began = max(rnd.opened, joined[p].joined if p in joined else rnd.opened)
        seconds[p] = rnd.ready_at.get(p, now) - rnd.claimed_at.get(p, began)
    dedloc_claims.record_round(r, job_id, rnd.examples, seconds)


def blame(
    r: redis.Redis, job_id: int, spec: DedlocSpec, peers: list[str], timed_out: tuple[int, int] | None = None
) -> set[str]:
    """One strike for each of `peers`; returns the peers excluded now (spec.exclude_after strikes in a
    row). When they `timed_out` in (step, attempt), the new peers among them (no committed round) that
    never took part in the reduction are excluded at once."""
    if timed_out is not None:
        step, attempt = timed_out
        # A new member that never took part in the reduction is the one its group waited on; one
        # that did (it published or fetched its group's address) was waiting on another.
        proven = dedloc_claims.established(r, job_id) | dedloc_claims.attended(r, job_id, step, attempt)
        newcomers = [p for p in peers if p not in proven]
        if newcomers:
            log.warning("job %s: new peers %s timed out in their first round: excluded", job_id, newcomers)
        dedloc_claims.shut_out(r, job_id, newcomers)
    for peer in peers:
        strikes = r.hincrby(keys.dedloc_strikes(job_id), peer, 1)
        if spec.exclude_after is not None and strikes == spec.exclude_after:
            log.warning(
                "job %s: peer %s excluded from matchmaking after %d aborted attempts in a row it was blamed for",
                job_id,
                peer,
                strikes,
            )
    return excluded(r, job_id, spec)


def excluded(r: redis.Redis, job_id: int, spec: DedlocSpec) -> set[str]:
    """Peers that take no part in matchmaking any more: new peers that timed out, and, at
    spec.exclude_after, peers blamed for that many aborted attempts in a row or refused that many state
    uploads (crowdtrain.server.services.dedloc_states) in all."""
    shut_out = dedloc_claims.shut_out_peers(r, job_id)
    if spec.exclude_after is None:
        return shut_out
    counts = [*r.hgetall(keys.dedloc_strikes(job_id)).items(), *r.hgetall(keys.dedloc_state_strikes(job_id)).items()]
    return shut_out | {keys.text(p) for p, n in counts if int(n) >= spec.exclude_after}


def commit_of(r: redis.Redis, job_id: int, step: int) -> dict | None:
    raw = r.hget(keys.dedloc_commits(job_id), str(step))
    return None if raw is None else json.loads(raw)


def check_member(rnd: Round, peer_id: str, step: int, attempt: int) -> None:
    """Raise unless `peer_id` is a member of the running reduction (step, attempt)."""
    if rnd.phase != RoundPhase.reducing or rnd.step != step or rnd.attempt != attempt:
        raise RoundGone(
            f"step {step} attempt {attempt} is not running (now step {rnd.step} attempt {rnd.attempt}, {rnd.phase})"
        )
    if peer_id not in rnd.members:
        raise NotAMember(f"peer {peer_id} is not a member of step {step} attempt {attempt}")


def group_of(rnd: Round, peer_id: str) -> int | None:
    for index, group in enumerate(rnd.groups):
        if peer_id in group:
            return index
    return None
