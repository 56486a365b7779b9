"""The training simulator's timing model (crowdtrain.sim.hosts): wall time against the VC-ASGD paper's
model, transfers per workunit and shard, and the spread of host speeds.

Fast: a tiny synthetic dataset, in the compute-free mode.
"""

import math
import statistics

import numpy as np
import pytest

from crowdtrain.sim.hosts import Fleet, expected_wall_time, paper_wall_time
from crowdtrain.workgen.datasets import Dataset
from tests.crowdtrain.sim.conftest import PAPER, job, timed


def mean_wall_time(data: Dataset, p: float, t_o: float, seeds: int) -> float:
    """8 slots of identical speed, 10 epochs of 32 workunits of t_e = 1 s: n = 40 workunits per slot."""
    return statistics.fmean(
        timed(job(32, 10), data, hosts=4, slots=2, p=p, timeout=t_o, seed=seed, **PAPER).sim_seconds
        for seed in range(seeds)
    )


@pytest.mark.parametrize("p", [0.0, 0.05, 0.2])
def test_wall_time_is_the_vc_asgd_papers_within_10_percent(blobs: Dataset, p: float) -> None:
    """n*t_e + n*p*t_o, averaged over 6 seeds, with a deadline t_o = 1.2 t_e."""
    model = paper_wall_time(40, 1.0, p, 1.2)
    assert abs(mean_wall_time(blobs, p, 1.2, seeds=6) - model) <= 0.10 * model


def test_wall_time_with_a_long_timeout_is_the_exact_expectation(blobs: Dataset) -> None:
    """With t_o = 3 t_e re-runs preempted again matter: n*t_e + n*p/(1-p)*t_o, 9.4% above the
    paper's first-order figure for p = 0.2, is what the simulation gives (epoch stragglers add a few %)."""
    wall = mean_wall_time(blobs, 0.2, 3.0, seeds=8)
    assert 0.97 * expected_wall_time(40, 1.0, 0.2, 3.0) <= wall <= 1.08 * expected_wall_time(40, 1.0, 0.2, 3.0)


@pytest.mark.parametrize("prefetch", [False, True])
def test_network_time_is_two_transfers_per_workunit_and_one_per_shard_first_fetched(
    blobs: Dataset, prefetch: bool
) -> None:
    """One slot, no preemption: every workunit downloads the snapshot and uploads its result; a
    shard is downloaded once, then found in the host's cache. The client asks for work as soon as
    a slot stops training, so an upload overlaps the next download; with prefetch the next
    assignment's downloads overlap training too, and only the first downloads and the last upload
    are left."""
    r = timed(job(4, 3), blobs, hosts=1, network_seconds=0.25, prefetch=prefetch)
    expected = 2 * 0.25 + 12 * 1.0 + 0.25 if prefetch else 12 * (1.0 + 0.25) + 4 * 0.25 + 0.25
    assert r.sim_seconds == pytest.approx(expected)


def test_host_speeds_vary_around_a_mean_of_one(blobs: Dataset) -> None:
    """Heterogeneous speeds stretch some hosts' work and shorten others'; one host alone has speed 1,
    so a speedup over one slot does not depend on the seed's draw."""

    def wall(hosts: int, sigma: float) -> float:
        return timed(job(8, 2), blobs, hosts=hosts, speed_sigma=sigma, seed=3).sim_seconds

    assert wall(1, 0.8) == wall(1, 0.0) == 16.0
    assert wall(4, 0.8) > wall(4, 0.0) == 4.0  # the slowest host holds each epoch's release back


def test_assignment_jitter_has_mean_one_and_its_spread() -> None:
    draws = np.array([Fleet(jitter_sigma=0.4).jitter(np.random.default_rng(s)) for s in range(4000)])
    assert draws.mean() == pytest.approx(1.0, abs=0.02)
    assert np.log(draws).std() == pytest.approx(0.4, rel=0.05)
    rng = np.random.default_rng(0)
    assert Fleet().jitter(rng) == 1.0 and rng.random() == np.random.default_rng(0).random()  # nothing drawn


def test_jitter_changes_which_slot_finishes_first_but_not_the_mean_wall_time(blobs: Dataset) -> None:
    """One host of 4 slots: without jitter every slot ends its workunit at the same instant; with it
    the order of merges differs from seed to seed, and the wall time stays about the same."""

    def run(seed: int, sigma: float):
        return timed(job(8, 4), blobs, hosts=1, slots=4, seed=seed, jitter_sigma=sigma)

    steady = run(0, 0.0)
    assert steady.sim_seconds == 8.0
    jittered = [run(seed, 0.3) for seed in range(12)]
    orders = {tuple(r.merged) for r in jittered}
    assert len(orders) > 1 and tuple(steady.merged) == tuple(sorted(steady.merged))
    # 4 slots each doing 8 workunits of mean 1 s: the wall time is about 8 s, a little above
    # (each epoch waits for its slowest of 8 draws), never a multiple of it.
    assert 8.0 < statistics.fmean(r.sim_seconds for r in jittered) < 8.0 * math.exp(0.3)


def test_a_late_snapshot_takes_the_prefetch_wait_out_of_staleness(blobs: Dataset) -> None:
    """With prefetch each host holds one assignment more than its slots; bound at dispatch, that one's
    snapshot ages while it waits for a slot. Bound when the slot starts it, its staleness is only the
    merges during its own training: lower on average, and never above the dispatch-bound run's most."""

    def staleness(late: bool) -> list[int]:
        return timed(job(16, 3), blobs, hosts=2, slots=2, late_snapshot=late).staleness

    early, late = staleness(False), staleness(True)
    assert len(early) == len(late) == 48
    assert statistics.fmean(late) < statistics.fmean(early) and max(late) <= max(early)
