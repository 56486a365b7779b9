"""A group's all-reduce (crowdtrain.client.dedloc.allreduce) among real processes over Gloo: exact in
float32, and within the format's rounding of the float32 result when the job compresses the wire."""

import multiprocessing as mp
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from crowdtrain.client.dedloc.allreduce import BUCKET_FLOATS, HeldGroup, ProcessGroups, reduce_round
from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.core.schemas_dedloc import RoundPlanOut

MEMBERS = 3
SIZE = BUCKET_FLOATS + 1000  # two buckets, the second short
EXAMPLES = [5, 7, 11]
HUGE = 1e9  # one element far beyond float16's range: clamped, never inf
COMPRESSIONS = ["none", "float16", "bfloat16"]


def gradient(rank: int) -> torch.Tensor:
    g = torch.from_numpy(np.random.default_rng(rank).standard_normal(SIZE, dtype=np.float32))
    g[1::97] *= 1e-6  # small values, near float16's subnormals
    if rank == 0:
        g[5] = HUGE
    return g


def member(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("s", store), rank, MEMBERS, timeout)
    api = PeerAPI("http://127.0.0.1:9")  # a kept group and one part: the round sends no request
    groups = ProcessGroups(api)
    groups.held = HeldGroup("s", pg, store)
    names = [f"p{i}" for i in range(MEMBERS)]
    plan = RoundPlanOut(
        step=0,
        attempt=0,
        members=names,
        examples=dict(zip(names, EXAMPLES, strict=True)),
        total=sum(EXAMPLES),
        relayed=False,
        group=0,
        group_members=names,
        rank=rank,
        session="s",
        new_session=False,
        needs_combining=False,
        parts=["group-0"],
        averaging_timeout=60,
    )
    grads = gradient(rank)
    for compression in COMPRESSIONS:  # rounds of one kept group, one per wire format
        average = reduce_round(api, plan, grads, groups, compression)
        assert torch.equal(grads, gradient(rank)), "the accumulated gradients were modified"
        results.put((compression, rank, average.numpy().copy()))  # the next round reuses its vector


@pytest.fixture(scope="module")
def averages() -> dict[str, list[np.ndarray]]:
    """compression -> each member's average, from one group of MEMBERS processes (spawning is slow)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = [ctx.Process(target=member, args=(r, host.port, results)) for r in range(MEMBERS)]
    for p in procs:
        p.start()
    got = {(c, r): a for c, r, a in (results.get(timeout=180) for _ in range(MEMBERS * len(COMPRESSIONS)))}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return {c: [got[c, r] for r in range(MEMBERS)] for c in COMPRESSIONS}


# Relative rounding of one value in the wire format (float32 for "none"), and its smallest step.
UNIT = {"none": (2.0**-24, 2.0**-149), "float16": (2.0**-11, 2.0**-24), "bfloat16": (2.0**-8, 2.0**-133)}


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_members_agree_exactly_and_the_average_is_within_the_wire_formats_rounding(
    averages: dict[str, list[np.ndarray]], compression: str
) -> None:
    results = averages[compression]
    assert all(np.array_equal(results[0], r) for r in results[1:]), "members hold different averages"
    average = results[0]
    assert np.isfinite(average).all()

    weighted = [gradient(r).double().numpy() / sum(EXAMPLES) for r in range(MEMBERS)]
    if compression == "float16":  # each contribution is clamped so that the group's sum stays finite
        limit = float(torch.finfo(torch.float16).max) / MEMBERS
        weighted = [np.clip(w, -limit, limit) for w in weighted]
    exact = np.sum(weighted, axis=0)
    magnitude = np.sum(np.abs(weighted), axis=0)
    relative, tiny = UNIT[compression]
    # Each member's value is rounded once onto the wire, each of the MEMBERS - 1 additions once, and
    # the sum once more: at most 2 * MEMBERS roundings of values no larger than `magnitude`.
    bound = 2 * MEMBERS * (relative * magnitude + tiny)
    error = np.abs(average.astype(np.float64) - exact)
    assert (error <= bound).all(), f"worst error {error.max():.3g} where the bound is {bound[error.argmax()]:.3g}"
    if compression != "none":  # the values really travelled in the compressed format
        wire = {"float16": torch.float16, "bfloat16": torch.bfloat16}[compression]
        back = torch.from_numpy(average).to(wire).float().numpy()
        assert np.array_equal(back, average)
