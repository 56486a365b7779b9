"""Pure math of the synchronous DeDLOC mode: step closing, member weights, all-reduce groups,
combining group sums, the learning-rate schedule, parameter digests and which uploaded state is the
collaboration's. No I/O.

A global step averages the gradients of every member of its round, each weighted by the examples it
contributed: with `g_i` the gradient of the *summed* loss over peer i's `n_i` examples,

    g = Σ_i g_i / N,   N = Σ_i n_i,

which is the gradient of the mean loss over the union of the members' examples: the step is the
step of single-process SGD on that global batch. Each member multiplies its `g_i` by `1/N` (the
same float for all), groups sum those with an all-reduce, and groups' sums are added in a fixed
order (`combine_parts`), so every member ends with bit-identical values.
"""

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

Params = dict[str, np.ndarray]

# A round's parts and total travel through the scheduler in chunks of this many float32 (8 MiB):
# held one at a time, summed as soon as every part has the chunk, read by members as they are summed.
RELAY_CHUNK_FLOATS = 1 << 21


def step_is_full(reported: Mapping[str, int], target_batch_size: int) -> bool:
    """The collaboration has accumulated a global batch: the step may close."""
    return sum(max(0, n) for n in reported.values()) >= target_batch_size


def round_members(reported: Mapping[str, int]) -> list[str]:
    """Peers that contribute to a closing step: those with examples, in a fixed (sorted) order."""
    return sorted(p for p, n in reported.items() if n > 0)


def member_weights(examples: Mapping[str, int]) -> dict[str, float]:
    """Each member's share of the round: its examples / the round's examples (they sum to 1)."""
    total = sum(examples.values())
    if total <= 0 or any(n < 0 for n in examples.values()):
        raise ValueError(f"a round needs a positive number of examples, got {dict(examples)}")
    return {p: n / total for p, n in examples.items()}


def form_groups(direct: Sequence[str], max_group_size: int) -> list[list[str]]:
    """Split the directly reachable members into the fewest groups of at most `max_group_size`,
    with sizes differing by at most one (balanced all-reduces finish together)."""
    if max_group_size < 1:
        raise ValueError("max_group_size must be at least 1")
    peers = sorted(direct)
    if not peers:
        return []
    count = math.ceil(len(peers) / max_group_size)
    base, extra = divmod(len(peers), count)
    groups, start = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(peers[start : start + size])
        start += size
    return groups


@dataclass(frozen=True)
class RoundPlan:
    """Who reduces with whom in one attempt of a step.

    `groups` all-reduce among themselves over the collective engine; `relayed` members send their
    weighted gradients to the server. When there is more than one part (several groups, or any
    relayed member), each group's rank 0 uploads its group's sum and every member downloads the sum
    of all parts, in the order of `parts`.
    """

    groups: list[list[str]]
    relayed: list[str]

    @property
    def parts(self) -> list[str]:
        return [f"group-{i}" for i in range(len(self.groups))] + [f"relay-{p}" for p in self.relayed]

    @property
    def needs_combining(self) -> bool:
        return len(self.parts) > 1


def plan_round(members: Sequence[str], relayed: set[str], max_group_size: int) -> RoundPlan:
    direct = [p for p in members if p not in relayed]
    return RoundPlan(form_groups(direct, max_group_size), sorted(p for p in members if p in relayed))


def group_sessions(groups: Sequence[Sequence[str]], kept: Mapping[str, str], tag: str) -> list[str]:
    """The process-group session of each group of a reduction: the session its members kept from the
    last round when that round committed with exactly this group (same members, same ranks), else a
    new one named after the reduction's `tag` (`new_session`), unique in the job. A kept session
    costs no rendezvous: its members reuse the process group they already hold."""
    return [kept.get(group_key(g), f"{tag}.{i}") for i, g in enumerate(groups)]


def group_key(group: Sequence[str]) -> str:
    """A group's members in rank order, as one string (a peer id never holds a comma)."""
    return ",".join(group)


def new_session(session: str, tag: str) -> bool:
    """The session was made for the reduction tagged `tag`: its members rendezvous before they reduce."""
    return session.startswith(f"{tag}.")


def combine_parts(parts: Sequence[Params]) -> Params:
    """Sum partial sums (groups' all-reduce results, relayed peers' weighted gradients) in the given
    order. Every caller that passes the same parts in the same order gets bit-identical sums."""
    if not parts:
        raise ValueError("nothing to combine")
    names = set(parts[0])
    for p in parts[1:]:
        if set(p) != names:
            raise ValueError(f"parts name different tensors: {sorted(names ^ set(p))[:5]}")
    out: Params = {}
    for name in parts[0]:
        acc = np.array(parts[0][name], dtype=parts[0][name].dtype, copy=True)
        for p in parts[1:]:
            if p[name].shape != acc.shape:
                raise ValueError(f"tensor {name!r}: shape {p[name].shape} differs from {acc.shape}")
            acc += p[name]
        out[name] = acc
    return out


def combine_chunks(chunks: Sequence[bytes | bytearray]) -> bytes:
    """Chunk i of the round's total from chunk i of every part (raw little-endian float32), added in
    the plan's order like `combine_parts`: the same bits as combining the whole parts."""
    if not chunks or len({len(c) for c in chunks}) != 1 or len(chunks[0]) % 4:
        raise ValueError(f"chunks of a round differ in size or are not float32: {[len(c) for c in chunks]}")
    acc = np.frombuffer(chunks[0], dtype="<f4").copy()
    for chunk in chunks[1:]:
        acc += np.frombuffer(chunk, dtype="<f4")
    return acc.tobytes()


def chunk_count(size: int) -> int:
    """How many relay chunks carry `size` floats."""
    return -(-size // RELAY_CHUNK_FLOATS)


def learning_rate(step: int, lr: float, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """The learning rate of global step `step` (0-based): linear warm-up, then constant or cosine
    decay to 0 at `max_steps`. Every peer computes the same value from the global step alone."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def digest(params: Mapping[str, np.ndarray]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal iff the tensors are identical."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def dissenters(digests: dict[str, str]) -> list[str]:
    """The members whose result differs from the one most members reported; every member when no result
    has more reports than all others. No I/O."""
    counts = Counter(digests.values())
    ranked = counts.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return sorted(digests)
    return sorted(peer for peer, digest in digests.items() if digest != ranked[0][0])


# A peer's claimed progress is believed up to this many times the rate it has shown (examples per
# second over its committed rounds), plus one micro-batch: an honest peer that speeds up (a volunteer's
# machine whose other load ends) is believed at once unless it more than quadruples, and a peer whose
# claim runs ahead counts for nothing until time catches up with it (a claim of 10^9 never does).
RATE_SLACK = 4.0


def measured_rate(examples: int, seconds: float) -> float:
    """Examples per second of a peer over its committed rounds (accumulating time only)."""
    return max(0, examples) / max(seconds, 1e-3)


def claim_bounds(
    rates: Mapping[str, float], elapsed: Mapping[str, float], target_batch_size: int, allowance: int
) -> dict[str, int]:
    """The most examples each peer of `elapsed` (seconds it has accumulated for this step) may claim:
    `allowance + RATE_SLACK · rate · elapsed`, at most one global batch (and the allowance a peer
    overshoots it by). The rate is the larger of the peer's own and the fastest established peer's:
    a peer's measured rate is what it contributed, not what it can compute (it stops once the others
    fill the batch), so its own rate alone would hold back an honest peer that fills a batch by
    itself, as a peer that just loaded a state does. With no established peer at all (the job's
    first rounds) the bound is the most, so that a peer alone can start the job.
    """
    fastest = max(rates.values(), default=None)
    most = target_batch_size + allowance
    if fastest is None:
        return dict.fromkeys(elapsed, most)
    return {
        peer: min(most, allowance + math.ceil(RATE_SLACK * max(rates.get(peer, 0.0), fastest) * max(0.0, seconds)))
        for peer, seconds in elapsed.items()
    }


def bounded_claims(claims: Mapping[str, int], bounds: Mapping[str, int]) -> dict[str, int]:
    """What each claim counts for toward closing a step: itself within its bound, else nothing (a
    claim beyond what the peer can have computed is false, or early; 0 for a peer with no bound)."""
    return {p: n if 0 <= n <= bounds.get(p, 0) else 0 for p, n in claims.items()}


def matchmaking_over(
    candidates: Sequence[str], ready: Mapping[str, int], waited_on: set[str], target_batch_size: int
) -> bool:
    """Members may be fixed before the deadline: every candidate of `waited_on` is ready, and either
    every candidate is or the ready ones hold a global batch. Which peers are waited on is the
    service's choice (crowdtrain.server.services.dedloc.awaited)."""
    if not (set(candidates) & waited_on) <= set(ready):
        return False
    return set(candidates) <= set(ready) or sum(ready.values()) >= target_batch_size


def choose_members(ready: Mapping[str, int]) -> list[str]:
    """The members of a round: every ready peer, new ones included. Otherwise a late volunteer could
    never complete a round while the established peers fill the batch, and would never become
    established. Its claim is within its bound (an over-claim is never ready), and a new member that
    then fails to reduce is excluded at that first timeout."""
    return sorted(ready)


class StateVerdict(StrEnum):
    """What becomes of an uploaded state of a step (`judge_state`)."""

    accepted = "accepted"  # its digest is the one a majority of the last commit's members hold
    refused = "refused"  # another digest: not the collaboration's parameters
    undecided = "undecided"  # no digest has a majority of the members' reports yet


def agreed_digest(reported: Mapping[str, str], members: Sequence[str]) -> str | None:
    """The parameter digest that more than half of `members` reported, else None. Reports of peers
    that are not members count for nothing, and a member counts once: a minority cannot outvote the
    others, however many peers it runs outside the commit."""
    if not members:
        return None
    counts = Counter(reported[m] for m in set(members) if reported.get(m))
    if not counts:
        return None
    top, n = counts.most_common(1)[0]
    return top if 2 * n > len(set(members)) else None


def judge_state(state_digest: str, agreed: str | None) -> StateVerdict:
    """A state is the collaboration's when its parameters' digest is the members' agreed one."""
    if agreed is None:
        return StateVerdict.undecided
    return StateVerdict.accepted if state_digest == agreed else StateVerdict.refused


@dataclass(frozen=True)
class StateUpload:
    """What the scheduler knows, while a step's state is awaited, to pick who uploads it."""

    members: Sequence[str]  # of the commit that produced the state
    uploader: str  # the commit's designated uploader
    reported: Mapping[str, str]  # peer -> the parameter digest it reported for the state's step
    refused: frozenset[str]  # members whose upload of this state was refused
    waited: float  # seconds since the commit
    grace: float  # seconds the designated uploader has before the other members are asked
    everyone: bool = False  # the job's last state: every member uploads it (the first ends the job)


def asked_to_upload(peer: str, s: StateUpload) -> bool:
    """Whether `peer` should upload the awaited state now: only a member holding the agreed digest,
    never one refused for it; the designated uploader first, and every other such member once the
    uploader was refused, reported other parameters, or let `grace` pass without uploading."""
    agreed = agreed_digest(s.reported, s.members)
    if agreed is None or peer not in s.members or s.reported.get(peer) != agreed or peer in s.refused:
        return False
    if s.everyone or peer == s.uploader:
        return True
    failed = s.uploader in s.refused or s.reported.get(s.uploader, agreed) != agreed
    return failed or s.waited > s.grace


def state_orphaned(members: Sequence[str], live: Set[str], excluded: Set[str], refused: Set[str]) -> bool:
    """No member of the commit that produced an awaited state can still upload it: each is gone (not
    live), excluded, or was refused for it. The collaboration must go back to its newest accepted
    state, or no newcomer could ever join it."""
    return not any(m in live and m not in excluded and m not in refused for m in members)
