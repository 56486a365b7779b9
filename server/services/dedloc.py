"""The rendezvous of the synchronous DeDLOC mode: step closing, rounds, commits, and peer liveness.

One job's round lives in Redis as one JSON document (`keys.dedloc_round`) that moves through

    accumulating --(live peers' reports reach target_batch_size)--> matchmaking (every live peer awaited)
    matchmaking  --(every candidate ready, or matchmaking_timeout)--> reducing (members fixed)
    reducing     --(every member reported the same result digest)--> accumulating at step + 1 (committed)
    reducing     --(a member failed, or averaging_timeout)--> matchmaking, attempt + 1 (aborted)

Each group of a reduction has a process-group session (`sessions`). A group made of exactly the
members, in the same ranks, of a group of the last round keeps that group's session when the last
round committed (`kept`), so its members reuse their process group and skip the rendezvous; an
abort forgets every kept session, so the retry's groups rendezvous anew whoever failed.

Each transition is one read-modify-write under the job's Redis lock, so any number of scheduler
workers agree. Nothing moves on a timer: the deadlines are checked by every peer request, and live
peers poll at least every `report_interval` seconds.

Guarantees: a step is committed at most once, with the members and result digest recorded in
`keys.dedloc_commits`; a peer applies a step only when it finds its own (step, attempt) there, so an
aborted attempt is applied by nobody and the collaboration never forks.
"""

import json
import logging
import time
from dataclasses import asdict, dataclass, field

import redis

from crowdtrain.core import dedloc, keys
from crowdtrain.core.jobspec import DedlocSpec

log = logging.getLogger(__name__)

ARTIFACT_TTL = 3600  # seconds rendezvous keys and round blobs are kept


def liveness_window(spec: DedlocSpec) -> float:
    """A peer silent for longer than this is left out of the next round."""
    return max(3 * spec.report_interval, 3.0)


@dataclass
class Round:
    """The coordinator's document for one job (see the module docstring)."""

    step: int = 0
    phase: str = "accumulating"
    attempt: int = 0
    candidates: list[str] = field(default_factory=list)
    ready: dict[str, int] = field(default_factory=dict)
    deadline: float = 0.0
    members: list[str] = field(default_factory=list)
    examples: dict[str, int] = field(default_factory=dict)
    groups: list[list[str]] = field(default_factory=list)
    relayed: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)  # one per group (see the module docstring)
    kept: dict[str, str] = field(default_factory=dict)  # group key -> session, from the last commit
    formed: int = 0  # reductions formed in this job: (step, attempt) may repeat, a session must not
    done: dict[str, str] = field(default_factory=dict)
    state_step: int = 0
    finished: bool = False

    @property
    def total(self) -> int:
        return sum(self.examples.values())

    @property
    def tag(self) -> str:
        """Names the running reduction's new sessions: unique in the job, since a step that finds no
        members goes back to accumulating and its next reduction is attempt 0 again."""
        return f"{self.step}.{self.attempt}.{self.formed}"

    @property
    def plan(self) -> dedloc.RoundPlan:
        return dedloc.RoundPlan(self.groups, self.relayed)


@dataclass(frozen=True)
class Peer:
    host_id: int
    relayed: bool
    last_seen: float


class RoundGone(Exception):
    """The (step, attempt) a request names is no longer the running one (aborted or committed)."""


class NotAMember(Exception):
    pass


def open_job(r: redis.Redis, job_id: int) -> None:
    r.set(keys.dedloc_round(job_id), json.dumps(asdict(Round())), nx=True)


def load(r: redis.Redis, job_id: int) -> Round | None:
    raw = r.get(keys.dedloc_round(job_id))
    return None if raw is None else Round(**json.loads(raw))


def save(r: redis.Redis, job_id: int, rnd: Round) -> None:
    r.set(keys.dedloc_round(job_id), json.dumps(asdict(rnd)))


def lock(r: redis.Redis, job_id: int):
    return r.lock(keys.dedloc_lock(job_id), timeout=30, blocking_timeout=30)


def peers(r: redis.Redis, job_id: int) -> dict[str, Peer]:
    return {keys.text(k): Peer(**json.loads(v)) for k, v in r.hgetall(keys.dedloc_peers(job_id)).items()}


def join(r: redis.Redis, job_id: int, peer_id: str, host_id: int, relayed: bool) -> None:
    r.hset(keys.dedloc_peers(job_id), peer_id, json.dumps(asdict(Peer(host_id, relayed, time.time()))))


def touch(r: redis.Redis, job_id: int, peer_id: str, host_id: int) -> Peer:
    raw = r.hget(keys.dedloc_peers(job_id), peer_id)
    if raw is None:
        raise NotAMember(f"peer {peer_id} has not joined job {job_id}")
    peer = Peer(**json.loads(raw))
    if peer.host_id != host_id:
        raise NotAMember(f"peer {peer_id} belongs to another host")
    peer = Peer(peer.host_id, peer.relayed, time.time())
    r.hset(keys.dedloc_peers(job_id), peer_id, json.dumps(asdict(peer)))
    return peer


def live_peers(r: redis.Redis, job_id: int, spec: DedlocSpec) -> dict[str, Peer]:
    horizon = time.time() - liveness_window(spec)
    return {p: v for p, v in peers(r, job_id).items() if v.last_seen >= horizon}


def advance(r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, max_steps: int) -> Round:
    """Apply every transition that is due now (step full, matchmaking over, averaging timed out)."""
    now = time.time()
    if rnd.finished:
        return rnd
    # Closing does not wait for the state upload of the last step: if its uploader died, the next
    # step's members upload a newer one, and newcomers sync to that.
    if rnd.phase == "accumulating" and rnd.step < max_steps:
        shut_out = excluded(r, job_id, spec)
        live = {p: v for p, v in live_peers(r, job_id, spec).items() if p not in shut_out}
        reported = {
            keys.text(k): int(v)
            for k, v in r.hgetall(keys.dedloc_progress(job_id, rnd.step)).items()
            if keys.text(k) in live
        }
        if dedloc.step_is_full(reported, spec.target_batch_size):
            rnd.phase, rnd.attempt, rnd.ready = "matchmaking", 0, {}
            # Every live peer is awaited (up to matchmaking_timeout), also one still applying the last
            # step or loading the state: otherwise a fast peer could close steps alone and leave the
            # others chasing the collaboration.
            rnd.candidates = sorted(live)
            rnd.deadline = now + spec.matchmaking_timeout
            log.info(
                "job %s: step %d closed with %d examples from %s",
                job_id,
                rnd.step,
                sum(reported.values()),
                rnd.candidates,
            )
    if rnd.phase == "matchmaking" and (set(rnd.ready) >= set(rnd.candidates) or now > rnd.deadline):
        shut_out = excluded(r, job_id, spec)
        rnd.ready = {p: n for p, n in rnd.ready.items() if p not in shut_out}
        if not rnd.ready:
            log.warning(
                "job %s: step %d attempt %d found no members; accumulating again", job_id, rnd.step, rnd.attempt
            )
            rnd.phase = "accumulating"
        else:
            relayed = {p for p, v in peers(r, job_id).items() if v.relayed}
            rnd.members = sorted(rnd.ready)
            rnd.examples = dict(rnd.ready)
            plan = dedloc.plan_round(rnd.members, relayed, spec.max_group_size)
            rnd.groups, rnd.relayed, rnd.done = plan.groups, plan.relayed, {}
            rnd.formed += 1
            rnd.sessions = dedloc.group_sessions(plan.groups, rnd.kept, rnd.tag)
            rnd.phase, rnd.deadline = "reducing", now + spec.averaging_timeout
            dropped = sorted(set(rnd.candidates) - set(rnd.ready))
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
    if rnd.phase == "reducing" and now > rnd.deadline:
        missing = sorted(set(rnd.members) - set(rnd.done))
        abort(r, job_id, rnd, spec, f"averaging timed out waiting for {missing}", missing)
    return rnd


def abort(r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, reason: str, blamed: list[str]) -> None:
    """Abort the running attempt for every member; its members but the excluded are the candidates of
    the retry. `blamed` are the members that caused it: one strike each (`excluded`)."""
    shut_out = blame(r, job_id, spec, blamed)
    r.hset(
        keys.dedloc_aborts(job_id),
        f"{rnd.step}:{rnd.attempt}",
        json.dumps({"members": rnd.members, "reason": reason[:500], "blamed": blamed, "at": time.time()}),
    )
    log.warning(
        "job %s: step %d attempt %d aborted (%s); retrying without the peers that do not answer",
        job_id,
        rnd.step,
        rnd.attempt,
        reason,
    )
    rnd.candidates, rnd.ready, rnd.done = [m for m in rnd.members if m not in shut_out], {}, {}
    rnd.members, rnd.examples, rnd.groups, rnd.relayed = [], {}, [], []
    rnd.sessions, rnd.kept = [], {}  # a member may hold a broken process group: every group meets anew
    rnd.phase, rnd.attempt = "matchmaking", rnd.attempt + 1
    rnd.deadline = time.time() + spec.matchmaking_timeout


def record_done(
    r: redis.Redis, job_id: int, rnd: Round, spec: DedlocSpec, peer_id: str, step: int, attempt: int, result_digest: str
) -> dict | None:
    """A member finished its reduction; returns the commit record when this completes the round."""
    if rnd.phase != "reducing" or rnd.step != step or rnd.attempt != attempt:
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
        abort(r, job_id, rnd, spec, f"members' results differ: {rnd.done}", dedloc.dissenters(rnd.done))
        return None
    commit = {
        "step": step,
        "attempt": attempt,
        "members": rnd.members,
        "examples": rnd.examples,
        "digest": result_digest,
        "uploader": rnd.members[0],
        "at": time.time(),
    }
    r.hset(keys.dedloc_commits(job_id), str(step), json.dumps(commit))
    r.hdel(keys.dedloc_strikes(job_id), *rnd.members)  # their runs of blamed aborts end
    log.info(
        "job %s: step %d committed (attempt %d, %d members, %d examples)",
        job_id,
        step,
        attempt,
        len(rnd.members),
        rnd.total,
    )
    rnd.kept = {dedloc.group_key(g): s for g, s in zip(rnd.groups, rnd.sessions, strict=True)}
    rnd.step, rnd.phase, rnd.attempt = step + 1, "accumulating", 0
    rnd.candidates, rnd.ready, rnd.members, rnd.examples, rnd.groups, rnd.relayed, rnd.done = [], {}, [], {}, [], [], {}
    rnd.sessions = []
    r.expire(keys.dedloc_progress(job_id, step), ARTIFACT_TTL)
    return commit


def blame(r: redis.Redis, job_id: int, spec: DedlocSpec, peers: list[str]) -> set[str]:
    """One strike for each of `peers`; returns the peers excluded now (spec.exclude_after strikes in a row)."""
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
    """Peers that take no part in matchmaking any more (spec.exclude_after): strikes of aborted attempts
    in a row, or refused state uploads (crowdtrain.server.services.dedloc_states) in all."""
    if spec.exclude_after is None:
        return set()
    counts = [*r.hgetall(keys.dedloc_strikes(job_id)).items(), *r.hgetall(keys.dedloc_state_strikes(job_id)).items()]
    return {keys.text(p) for p, n in counts if int(n) >= spec.exclude_after}


def commit_of(r: redis.Redis, job_id: int, step: int) -> dict | None:
    raw = r.hget(keys.dedloc_commits(job_id), str(step))
    return None if raw is None else json.loads(raw)


def check_member(rnd: Round, peer_id: str, step: int, attempt: int) -> None:
    """Raise unless `peer_id` is a member of the running reduction (step, attempt)."""
    if rnd.phase != "reducing" or rnd.step != step or rnd.attempt != attempt:
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
