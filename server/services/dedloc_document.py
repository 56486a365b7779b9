"""A DeDLOC job's round as Redis holds it: one JSON document (`keys.dedloc_round`) per job, its
phases and the moves between them (ROUND_MOVES), and the job's lock every read-modify-write of it
holds. What the round does is crowdtrain.server.services.dedloc's."""

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import redis

from crowdtrain.core import dedloc, keys


class RoundPhase(StrEnum):
    """The phase of a job's round; ROUND_MOVES says which may follow which (the module docstring why)."""

    accumulating = "accumulating"
    matchmaking = "matchmaking"
    reducing = "reducing"


ROUND_MOVES: dict[RoundPhase, frozenset[RoundPhase]] = {
    # step full: matchmaking; the awaited state can no longer be uploaded: rewound to an older step
    RoundPhase.accumulating: frozenset({RoundPhase.matchmaking, RoundPhase.accumulating}),
    # members fixed: reducing; no member came ready, or rewound: accumulating again
    RoundPhase.matchmaking: frozenset({RoundPhase.reducing, RoundPhase.accumulating}),
    # committed: the next step accumulates; aborted: matchmaking for the next attempt
    RoundPhase.reducing: frozenset({RoundPhase.accumulating, RoundPhase.matchmaking}),
}


LOCK_POLL_S = 0.002  # how often a request waiting for the job's round lock asks for it again


class IllegalRoundMove(RuntimeError):
    """A move that ROUND_MOVES does not allow: a bug in the coordinator, never a peer's doing."""


@dataclass
class Round:
    """The coordinator's document for one job (see the module docstring)."""

    step: int = 0
    phase: RoundPhase = RoundPhase.accumulating
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
    opened: float = 0.0  # when the running step began accumulating (its predecessor's commit)
    ready_at: dict[str, float] = field(default_factory=dict)  # when each ready peer first said so
    claimed_at: dict[str, float] = field(default_factory=dict)  # when each peer first claimed examples for the step

    def __post_init__(self) -> None:
        self.phase = RoundPhase(self.phase)  # a stored document holds the phase's name

    def move(self, to: RoundPhase) -> None:
        """Enter phase `to`; raises IllegalRoundMove unless ROUND_MOVES allows it from the phase now."""
        if to not in ROUND_MOVES[self.phase]:
            raise IllegalRoundMove(f"step {self.step} attempt {self.attempt}: no move from {self.phase} to {to}")
        self.phase = to

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


class RoundGone(Exception):
    """The (step, attempt) a request names is no longer the running one (aborted or committed)."""


def open_job(r: redis.Redis, job_id: int) -> None:
    r.set(keys.dedloc_round(job_id), json.dumps(asdict(Round())), nx=True)


def load(r: redis.Redis, job_id: int) -> Round | None:
    raw = r.get(keys.dedloc_round(job_id))
    return None if raw is None else Round(**json.loads(raw))


def save(r: redis.Redis, job_id: int, rnd: Round) -> None:
    """Store the document; a change is announced to the reports held open for one (keys.dedloc_changed)."""
    doc = json.dumps(asdict(rnd)).encode()
    if r.set(keys.dedloc_round(job_id), doc, get=True) != doc:
        r.publish(keys.dedloc_changed(job_id), b"")


def lock(r: redis.Redis, job_id: int):
    """The job's round lock. A request that finds it held asks again every LOCK_POLL_S (redis-py's
    default, 0.1 s, made the members of a round hear of it up to 0.1 s apart: they all ask at once)."""
    return r.lock(keys.dedloc_lock(job_id), timeout=30, blocking_timeout=30, sleep=LOCK_POLL_S)
