"""Service layer of the DeDLOC mode, the relay: the parts of a round that needs combining (each
group's sum from its rank 0, each relayed member's weighted gradient) and their total.

A part travels as raw little-endian float32, cut into chunks of `RELAY_CHUNK_FLOATS` that go to
Redis as they arrive. Chunk i of the total is chunk i of every part added in the plan's order
(`combine_chunks`, the same bits as `combine_parts` over whole parts); the upload that completes it
computes it, writes it once (SET NX: two that race write the same bytes) and deletes the parts'
chunks. Members read the total chunk by chunk as it is written, so nothing holds a whole part and
the sum of the first chunks travels while the last ones are still being uploaded. The process that
sums a chunk keeps it a while (`RecentTotals`), so its own readers need not fetch it back from Redis.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import redis

from crowdtrain.core import dedloc as math
from crowdtrain.core import keys
from crowdtrain.core.refusals import RefusalKind
from crowdtrain.server.services import dedloc, dedloc_document
from crowdtrain.server.services.dedloc_jobs import DedlocProblem, joined_round
from crowdtrain.server.services.dedloc_rounds import running_member

CHUNK_BYTES = 4 * math.RELAY_CHUNK_FLOATS
POLL = 0.002  # seconds between looks for a chunk of the total that is not summed yet
RECHECK = 0.5  # seconds between looks at whether the round still runs, while a reader waits
RECENT_TOTAL_BYTES = 256 << 20  # total chunks kept in this process for its readers (`RecentTotals`)


def check_part(
    r: redis.Redis,
    job_id: int,
    host_id: int,
    peer_id: str,
    step: int,
    attempt: int,
    part: str,
    size: int,
    now: float,
) -> list[str]:
    """Refuse the upload of `part` unless it is the caller's (a relayed member's own, or its group's
    from the group's rank 0) in the attempt running at `now` and `size` is the round's; the round's parts."""
    rnd = running_member(r, job_id, host_id, peer_id, step, attempt, now)
    group = dedloc.group_of(rnd, peer_id)
    mine = f"relay-{peer_id}" if group is None else f"group-{group}"
    if part != mine or (group is not None and rnd.groups[group][0] != peer_id):
        raise DedlocProblem(
            RefusalKind.forbidden,
            f"peer {peer_id} may not upload part {part!r} (its part is {mine!r}, uploaded by the group's rank 0)",
        )
    _check_size(r, job_id, step, attempt, size)
    return rnd.plan.parts


def _check_size(r: redis.Redis, job_id: int, step: int, attempt: int, size: int) -> None:
    name = keys.dedloc_part_size(job_id, step, attempt)
    r.set(name, size, nx=True, ex=dedloc.ARTIFACT_TTL)
    agreed = int(r.get(name) or size)
    if agreed != size:
        raise DedlocProblem(RefusalKind.malformed, f"parts of this round have {agreed} floats, not {size}")


def put_chunk(
    r: redis.Redis,
    job_id: int,
    step: int,
    attempt: int,
    parts: list[str],
    part: str,
    index: int,
    chunk: bytes | bytearray,
) -> bool:
    """Store chunk `index` of `part`; True when that completed chunk `index` of the total.

    The other parts' chunks are read back, this one is used as uploaded: every uploader writes its
    chunk before it reads, so of two racing uploads at least the later one sees both."""
    r.set(keys.dedloc_part(job_id, step, attempt, part, index), chunk, ex=dedloc.ARTIFACT_TTL)
    others = [keys.dedloc_part(job_id, step, attempt, p, index) for p in parts if p != part]
    found = [c for c in (r.mget(others) if others else []) if isinstance(c, bytes)]  # one not uploaded yet is None
    total = keys.dedloc_total(job_id, step, attempt, index)
    if len(found) < len(others) or r.exists(total):
        return False
    by_part: dict[str, bytes | bytearray] = dict(zip((p for p in parts if p != part), found, strict=True))
    by_part[part] = chunk
    try:
        summed = math.combine_chunks([by_part[p] for p in parts])
    except ValueError as exc:
        raise DedlocProblem(RefusalKind.malformed, str(exc)) from None
    if r.set(total, summed, ex=dedloc.ARTIFACT_TTL, nx=True):
        _recent_totals.put(total, summed)
    r.delete(keys.dedloc_part(job_id, step, attempt, part, index), *others)
    return True


class RecentTotals:
    """The total chunks this process summed last, up to `limit` bytes: a member streaming the total
    from the process that summed it reads them here instead of from Redis (another process's reader
    finds them in Redis). Only a chunk this process wrote first (SET NX) is kept, so both agree."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.chunks: OrderedDict[str, bytes] = OrderedDict()
        self.lock = threading.Lock()

    def put(self, name: str, chunk: bytes) -> None:
        with self.lock:
            self.chunks[name] = chunk
            self.held += len(chunk)
            while self.held > self.limit:
                self.held -= len(self.chunks.popitem(last=False)[1])

    def get(self, name: str) -> bytes | None:
        with self.lock:
            return self.chunks.get(name)


_recent_totals = RecentTotals(RECENT_TOTAL_BYTES)


def total_chunks(
    r: redis.Redis, job_id: int, host_id: int, peer_id: str, step: int, attempt: int, size: int, now: float
) -> Iterator[bytes]:
    """The round's total, chunk by chunk as it is summed, for a member of the attempt running at `now`.

    Refuses at once (before anything is sent) a caller that is not a member or a size that is not
    the round's; the stream ends early when the attempt ends (aborted, or past its deadline: `now`
    plus the time the stream has waited) before its total is complete, and the member sees a short body.
    """
    running_member(r, job_id, host_id, peer_id, step, attempt, now)
    _check_size(r, job_id, step, attempt, size)
    return _stream_total(r, job_id, step, attempt, size, now)


def _stream_total(r: redis.Redis, job_id: int, step: int, attempt: int, size: int, now: float) -> Iterator[bytes]:
    started = time.monotonic()
    for index in range(math.chunk_count(size)):
        name, checked = keys.dedloc_total(job_id, step, attempt, index), time.monotonic()
        while (chunk := _recent_totals.get(name) or r.get(name)) is None:
            if time.monotonic() - checked > RECHECK:
                rnd, checked = joined_round(r, job_id), time.monotonic()
                if rnd.phase != dedloc_document.RoundPhase.reducing or (rnd.step, rnd.attempt) != (step, attempt):
                    return
                if now + (time.monotonic() - started) > rnd.deadline:
                    return
            time.sleep(POLL)
        assert isinstance(chunk, bytes)  # ours are bytes (no `decode_responses`)
        yield chunk
