"""One round's reduction as a member performs it: weight, all-reduce within the group over
torch.distributed (Gloo), and combine with the other parts through the scheduler when needed.

A group's process group is kept across rounds (`ProcessGroups`) while the scheduler names the same
session; a new session meets through a TCPStore that the group's rank 0 hosts, whose address is the
only key that travels through the scheduler. The vector is reduced in buckets of
`BUCKET_FLOATS`, each all-reduced asynchronously as soon as it is weighted, so weighting,
communication and (in a round that needs combining) the upload of the group's sum pipeline. A job
may send the all-reduce's buckets as 16-bit floats (`BucketedAllReduce`).
"""

import hashlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import httpx
import torch
import torch.distributed as dist

from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.client.dedloc.store import RoundStore
from crowdtrain.core.dedloc import RELAY_CHUNK_FLOATS
from crowdtrain.core.schemas_dedloc import RoundPlanOut

log = logging.getLogger(__name__)

# One bucket is one chunk of the relay, so a bucket reduced is a chunk ready to upload.
BUCKET_FLOATS = RELAY_CHUNK_FLOATS
# The job spec's `dedloc.compression`: the number format of a group's all-reduce (None: float32, exact).
WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORE_ADDRESS_KEY = "tcpstore-address"  # then "/" and the session: a stale address is never read


def result_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()


def local_address(server: str) -> str:
    """This machine's address on the route to the scheduler (no packet is sent): where the other
    members of a group, who reach the scheduler too, can reach this peer's store."""
    url = httpx.URL(server)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((url.host, url.port or (443 if url.scheme == "https" else 80)))
        return str(probe.getsockname()[0])


@dataclass
class HeldGroup:
    session: str | None
    pg: dist.ProcessGroupGloo
    store: dist.Store  # rank 0's store serves the group's other members for as long as the group lives


def rendezvous(api: PeerAPI, plan: RoundPlanOut) -> HeldGroup:
    """Build the group's process group: rank 0 starts a TCPStore and publishes its address with one
    request to the scheduler; the others fetch it (one long-polled request) and meet there."""
    if plan.rank is None:  # the scheduler gives a rank to every member of a group, and none to a relayed peer
        raise ValueError(f"step {plan.step} attempt {plan.attempt}: this peer has no rank in a group to reduce with")
    timeout = timedelta(seconds=plan.averaging_timeout)
    round_store = RoundStore(api, plan.step, plan.attempt, plan.averaging_timeout)
    if plan.rank == 0:
        host = local_address(str(api.http.base_url))
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        round_store.set(f"{STORE_ADDRESS_KEY}/{plan.session}", f"{host}:{store.port}")
    else:
        host, port = round_store.get(f"{STORE_ADDRESS_KEY}/{plan.session}").decode().rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    prefix = plan.session or f"{plan.step}.{plan.attempt}"
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), plan.rank, len(plan.group_members), timeout)
    return HeldGroup(plan.session, pg, store)


class ProcessGroups:
    """The process group this peer holds, kept across rounds for as long as the scheduler names its
    session. Holds at most one: a round of another session drops it (closing its connections)."""

    def __init__(self, api: PeerAPI):
        self.api = api
        self.held: HeldGroup | None = None
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def buffer(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A vector of `size` values of `dtype`, the same one every round: a fresh 100 MB vector costs
        its page faults on every round, as much as the all-reduce itself on two loaded cores."""
        held = self.buffers.get(dtype)
        if held is None or len(held) != size:
            held = self.buffers[dtype] = torch.empty(size, dtype=dtype)
        return held

    def for_round(self, plan: RoundPlanOut) -> dist.ProcessGroupGloo:
        if self.held is not None and plan.session is not None and self.held.session == plan.session:
            return self.held.pg
        self.drop()
        if not plan.new_session:
            # The others reuse a group this peer no longer holds: fail, so the round is retried anew.
            raise RuntimeError(f"step {plan.step} attempt {plan.attempt}: session {plan.session} is not held here")
        self.held = rendezvous(self.api, plan)
        log.info(
            "peer %s: new process group for session %s (rank %s of %d)",
            self.api.peer_id,
            plan.session,
            plan.rank,
            len(plan.group_members),
        )
        return self.held.pg

    def drop(self) -> None:
        """Forget the held group (after a failed round, or for another session)."""
        self.held = None


def _buckets(n: int) -> list[slice]:
    return [slice(start, min(start + BUCKET_FLOATS, n)) for start in range(0, n, BUCKET_FLOATS)]


class BucketedAllReduce:
    """The buckets of one reduction into `out` (float32) over `pg`, each scaled and all-reduced
    asynchronously as soon as it is `start`ed; `settled` waits for them in order and leaves each
    one's sum in `out`.

    With a compressed wire (`wire`, a vector of the format of the job spec's `dedloc.compression`,
    as long as `out`) a bucket is scaled into that format, all-reduced there (Gloo sums in it) and
    cast back: half the bytes on the wire. float16 values are first clamped to the format's range
    over the group's size, so the group's sum stays finite; bfloat16 has float32's range. Gloo
    hands every member the same reduced bits, so members still agree exactly with one another.
    Without a group (`pg` None) nothing travels or is cast.
    """

    def __init__(self, out: torch.Tensor, pg: dist.ProcessGroupGloo | None, wire: torch.Tensor | None):
        self.out, self.pg = out, pg
        self.wire = out if wire is None or pg is None else wire
        clamped = self.wire.dtype == torch.float16
        self.limit = torch.finfo(torch.float16).max / pg.size() if clamped and pg is not None else None
        self.pending: list[tuple[slice, dist.Work | None]] = []

    def start(self, bucket: slice, source: torch.Tensor, scale: float) -> None:
        """Scale `source[bucket]` (the same float product as `mul_(scale)`) and all-reduce it."""
        if self.limit is None:  # float32, or bfloat16 cast as the product is stored
            torch.mul(source[bucket], scale, out=self.wire[bucket])
        else:
            torch.mul(source[bucket], scale, out=self.out[bucket])
            self.wire[bucket].copy_(self.out[bucket].clamp_(-self.limit, self.limit))
        # torch's stubs leave out Backend.allreduce, which ProcessGroupGloo has at run time.
        work = self.pg.allreduce([self.wire[bucket]]) if self.pg is not None else None  # type: ignore[attr-defined]
        self.pending.append((bucket, work))

    def settled(self) -> Iterator[slice]:
        for bucket, work in self.pending:
            if work is not None:
                work.wait()
            if self.wire is not self.out:
                self.out[bucket].copy_(self.wire[bucket])
            yield bucket


def _chunks(reduction: BucketedAllReduce) -> Iterator[bytes]:
    """The bytes of the reduced vector bucket by bucket, each once its all-reduce (if any) is complete."""
    array = reduction.out.numpy()
    for bucket in reduction.settled():
        yield array[bucket].tobytes()


def reduce_round(
    api: PeerAPI,
    plan: RoundPlanOut,
    summed_grads: torch.Tensor,
    groups: ProcessGroups | None = None,
    compression: str = "none",
) -> torch.Tensor:
    """The round's average gradient Σ_i g_i / N, identical on every member: a vector of `groups`
    that its next round overwrites (copy what must outlive it).

    `summed_grads` (the gradient of this peer's summed loss) is never modified: the reduction works
    on a copy, so a failed round leaves the peer's accumulated gradients intact. `compression` (the
    job spec's `dedloc.compression`) is the number format of the group's all-reduce. A failure drops
    the held process group (a peer of it may be gone or out of step); the caller reports the failure.
    """
    groups = groups or ProcessGroups(api)
    if compression not in WIRE_DTYPES:
        raise ValueError(f"unknown all-reduce compression {compression!r}; known: {', '.join(WIRE_DTYPES)}")
    try:
        return _reduce(api, plan, summed_grads, groups, WIRE_DTYPES[compression])
    except BaseException:
        groups.drop()
        raise


def _reduce(
    api: PeerAPI, plan: RoundPlanOut, summed_grads: torch.Tensor, groups: ProcessGroups, wire: torch.dtype | None
) -> torch.Tensor:
    source = summed_grads.detach()
    out = groups.buffer(len(source), source.dtype)
    scale = 1.0 / plan.total
    pg = groups.for_round(plan) if not plan.relayed and len(plan.group_members) > 1 else None
    reduction = BucketedAllReduce(out, pg, groups.buffer(len(out), wire) if wire is not None else None)
    for bucket in _buckets(len(out)):
        reduction.start(bucket, source, scale)
    if not plan.needs_combining:
        for _ in reduction.settled():
            pass
        return out
    part = f"relay-{api.peer_id}" if plan.relayed else f"group-{plan.group}"
    if plan.relayed or plan.rank == 0:
        api.put_part(plan.step, plan.attempt, part, len(out), _chunks(reduction))
        broadcasts = []

        def arrived(start: int, stop: int) -> None:
            if pg is not None:  # the group's other members get the total (float32) from their rank 0
                broadcasts.append(pg.broadcast(out[start:stop], 0))  # type: ignore[attr-defined]

        api.total_into(plan.step, plan.attempt, out.numpy(), BUCKET_FLOATS, arrived)
        for work in broadcasts:
            work.wait()
        return out
    assert pg is not None  # a member with a rank other than 0 is in a group of two or more
    for _ in reduction.settled():
        pass
    for work in [pg.broadcast(out[bucket], 0) for bucket in _buckets(len(out))]:  # type: ignore[attr-defined]
        work.wait()
    return out
