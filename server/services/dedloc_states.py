"""Service layer of the DeDLOC mode, which uploaded state is the collaboration's and who uploads it.

The members of a step's commit report the digest of the parameters they hold after applying it
(`Progress.params_digest`, kept in `keys.dedloc_digests`). The state of the next step is accepted
only when its parameters' digest is the one a majority of those members report
(crowdtrain.core.dedloc.agreed_digest): a member that uploads anything else, whatever digest it
reported itself, is refused and charged one state strike (`keys.dedloc_state_strikes`, never cleared
by a commit), and `spec.exclude_after` of them exclude it from matchmaking. The designated uploader
is asked first, the other members holding the agreed digest once it fails (crowdtrain.core.dedloc.
asked_to_upload). The decisions are values; crowdtrain.server.services.dedloc_jobs stores an
accepted state and answers a refusal.
"""

import logging
from dataclasses import dataclass

import redis

from crowdtrain.core import dedloc as math
from crowdtrain.core import keys
from crowdtrain.core.dedloc import StateVerdict
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.server.services import dedloc, dedloc_peers
from crowdtrain.server.services.dedloc_document import Round, RoundPhase

log = logging.getLogger(__name__)

REFUSALS_TTL = 24 * 3600  # seconds a step's refused uploads are remembered (its digests are kept as long)


@dataclass(frozen=True)
class StateJudgement:
    """What became of an uploaded state, and the message the uploader is answered with."""

    verdict: StateVerdict
    message: str


def reported_digests(r: redis.Redis, job_id: int, step: int) -> dict[str, str]:
    """Peer -> the digest of the parameters it reported holding at the start of `step`."""
    return {keys.text(k): keys.text(v) for k, v in r.hgetall(keys.dedloc_digests(job_id, step)).items()}


def refused_uploaders(r: redis.Redis, job_id: int, step: int) -> frozenset[str]:
    return frozenset(keys.text(p) for p in r.hkeys(keys.dedloc_state_refusals(job_id, step)))


def judge_upload(
    r: redis.Redis, job_id: int, spec: DedlocSpec, commit: dict, peer_id: str, step: int, state_digest: str
) -> StateJudgement:
    """Judge the state of `step` that `peer_id`, a member of `commit` (step - 1's), uploaded with
    parameters of digest `state_digest`. A refusal is charged once per peer and step, however often
    the same peer uploads again."""
    members = commit["members"]
    reported = reported_digests(r, job_id, step)
    agreed = math.agreed_digest(reported, members)
    verdict = math.judge_state(state_digest, agreed)
    if verdict is StateVerdict.undecided:
        have = sum(1 for m in members if m in reported)
        return StateJudgement(
            verdict,
            f"the {len(members)} members of step {step - 1} have not agreed on the parameters of step {step} yet "
            f"({have} reported): nothing stored; upload the state again when the scheduler asks (upload_state)",
        )
    if verdict is StateVerdict.refused:
        charge(r, job_id, spec, step, peer_id, state_digest)
        return StateJudgement(
            verdict,
            f"the state of step {step} has parameters of digest {state_digest[:16]}…, not {str(agreed)[:16]}… that "
            f"the members of step {step - 1} hold: refused, nothing stored, and counted against peer {peer_id}",
        )
    return StateJudgement(verdict, "")


def charge(r: redis.Redis, job_id: int, spec: DedlocSpec, step: int, peer_id: str, state_digest: str) -> None:
    """One state strike for `peer_id`'s refused state of `step` (the first refusal of that step only)."""
    if not r.hsetnx(keys.dedloc_state_refusals(job_id, step), peer_id, state_digest):
        return
    r.expire(keys.dedloc_state_refusals(job_id, step), REFUSALS_TTL)
    strikes = r.hincrby(keys.dedloc_state_strikes(job_id), peer_id, 1)
    log.warning(
        "job %s: peer %s uploaded a state of step %d whose parameters (digest %s) are not the members'; "
        "refused (%d refused state(s)%s)",
        job_id,
        peer_id,
        step,
        state_digest[:12],
        strikes,
        ", now excluded from matchmaking" if spec.exclude_after is not None and strikes == spec.exclude_after else "",
    )


def state_strikes(r: redis.Redis, job_id: int) -> dict[str, int]:
    """Peer -> how many of its uploaded states were refused, for the operator."""
    return {keys.text(k): int(v) for k, v in r.hgetall(keys.dedloc_state_strikes(job_id)).items()}


def asked_to_upload(
    r: redis.Redis, job_id: int, spec: DedlocSpec, rnd: Round, peer_id: str, max_steps: int, now: float
) -> bool:
    """Whether `peer_id`, holding the parameters of `rnd.step`, should upload its state now: the state
    is awaited (not yet accepted) and crowdtrain.core.dedloc.asked_to_upload picks this peer."""
    step = rnd.step
    if step < 1 or rnd.state_step >= step or rnd.finished:
        return False
    commit = dedloc.commit_of(r, job_id, step - 1)
    if commit is None or peer_id not in commit["members"]:
        return False
    upload = math.StateUpload(
        members=commit["members"],
        uploader=commit["uploader"],
        reported=reported_digests(r, job_id, step),
        refused=refused_uploaders(r, job_id, step),
        waited=now - float(commit["at"]),
        grace=dedloc_peers.liveness_window(spec),
        everyone=step >= max_steps,
    )
    return math.asked_to_upload(peer_id, upload)


def rewind_orphaned(r: redis.Redis, job_id: int, spec: DedlocSpec, rnd: Round, now: float) -> bool:
    """Send the collaboration back to its newest accepted state when the awaited one can no longer be
    uploaded (crowdtrain.core.dedloc.state_orphaned): say its only members were a poisoner, excluded
    once refused, or peers that left. The steps after the accepted state are forgotten (their commits,
    digests and refusals) and the accepted step is accumulated anew; `rnd` is changed in place, for
    the caller to save under the job's lock. True when it rewound."""
    if rnd.phase == RoundPhase.reducing or rnd.finished or rnd.state_step >= rnd.step:
        return False
    commit = dedloc.commit_of(r, job_id, rnd.step - 1)
    window = dedloc_peers.liveness_window(spec)
    live = {p for p, peer in dedloc_peers.peers(r, job_id).items() if now - peer.last_seen <= window}
    members = commit["members"] if commit else []
    refused = refused_uploaders(r, job_id, rnd.step)
    if not math.state_orphaned(members, live, dedloc.excluded(r, job_id, spec), refused):
        return False
    lost, back = rnd.step, rnd.state_step
    r.hdel(keys.dedloc_commits(job_id), *[str(s) for s in range(back, lost)])
    for step in range(back + 1, lost + 1):
        r.delete(keys.dedloc_digests(job_id, step), keys.dedloc_state_refusals(job_id, step))
    r.delete(keys.dedloc_progress(job_id, back))
    rnd.move(RoundPhase.accumulating)
    rnd.step, rnd.attempt = back, 0
    rnd.candidates, rnd.ready, rnd.members, rnd.examples, rnd.groups, rnd.relayed, rnd.done = [], {}, [], {}, [], [], {}
    rnd.sessions, rnd.kept = [], {}
    log.warning(
        "job %s: no member of step %d (%s) can upload the state of step %d any more; the collaboration goes "
        "back to step %d, its newest accepted state",
        job_id,
        lost - 1,
        members,
        lost,
        back,
    )
    return True
