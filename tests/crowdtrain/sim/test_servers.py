"""The simulator's parameter servers: a job's FIFO merge queue, its service times, and the backlog
and staleness that follow. Compute-free runs on a seeded simulation, no sleeps."""

import statistics

import pytest

from crowdtrain.sim.records import Assignment, Workunit
from crowdtrain.sim.servers import MergeQueue, ParameterServers
from crowdtrain.sim.training import simulate_training
from crowdtrain.workgen.datasets import Dataset
from tests.crowdtrain.sim.conftest import INSTANT, job


def result(i: int) -> Assignment:
    return Assignment(i, Workunit(i, 1, i), 0, 0, {}, 0.0, 60.0)


def test_one_pass_at_a_time_takes_the_oldest_results_up_to_max_pass() -> None:
    q = MergeQueue(ParameterServers(processes=2, merge_seconds=1.0, eval_seconds=0.0, pass_seconds=0.5, max_pass=2))
    for i in range(3):
        q.arrive(result(i), now=0.5 * i)
    batch, written_at = q.take(now=1.0)
    # The two oldest in one pass: 0.5 s for the pass and 1 s for each result; a second process waits.
    assert ([a.id for a in batch], written_at) == ([0, 1], 3.5)
    assert q.take(now=1.0) is None
    q.arrive(result(3), now=2.0)
    assert q.longest == 2  # waiting while a pass ran
    q.done()
    batch, written_at = q.take(now=3.5)
    assert ([a.id for a in batch], written_at) == ([2, 3], 6.0)
    assert q.waits == [1.0, 0.5, 2.5, 1.5] and q.passes == [2, 2]  # from arrival to the start of its pass
    q.done()
    assert q.take(now=6.0) is None  # nothing waits


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("processes", 0),
        ("merge_seconds", -1.0),
        ("eval_seconds", float("nan")),
        ("pass_seconds", -0.1),
        ("max_pass", 0),
    ],
)
def test_bad_service_settings_are_refused_naming_the_field(field: str, value: float) -> None:
    name = "parameter_servers" if field == "processes" else field
    with pytest.raises(ValueError, match=name):
        ParameterServers(**{field: value})


def run(data: Dataset, hosts: int = 4, eval_every: int = 1, **kwargs):
    """Identical hosts, 1 s of training per workunit, 32 shards: results arrive about hosts per second.
    Without the in-flight budget unless asked: these tests study the queue it would keep short."""
    settings = {"speed_sigma": 0.0, "workunit_seconds": 1.0, "compute": False, "data": data, "seed": 0}
    settings |= {"backpressure": False} | kwargs
    return simulate_training(job(32, 3, scheduling={"eval_every": eval_every}), hosts=hosts, **settings)


def test_a_merge_slower_than_the_results_builds_a_backlog_and_staleness_grows_with_it(blobs: Dataset) -> None:
    """4 hosts send about 4 results a second; merges of 0.5 s or 1 s cannot keep up (eval aside)."""
    runs = {m: run(blobs, merge_seconds=m, eval_seconds=0.0, pass_seconds=0.0) for m in (0.0, 0.1, 0.5, 1.0)}
    mean = {m: r.staleness_summary()["mean"] for m, r in runs.items()}
    assert mean[0.0] <= mean[0.1] < mean[0.5] < mean[1.0]
    assert runs[0.0].longest_backlog == 0 and max(runs[0.0].merge_waits) == 0
    assert runs[1.0].longest_backlog >= 4 and statistics.fmean(runs[1.0].merge_waits) > 1.0
    # The epoch-release window holds: no more than two epochs' workunits out, queued ones included.
    assert all(r.merges == 96 for r in runs.values())
    assert runs[1.0].sim_seconds >= 96 * 1.0


def test_with_instant_servers_and_no_prefetch_a_run_is_what_it_was_before_the_queue(blobs: Dataset) -> None:
    """The figures the simulator gave before merges took time and hosts prefetched (same seeds)."""
    for hosts, mean, seconds in ((8, 6.85, 0.24454582597471963), (32, 28.42, 0.06840654853987894)):
        r = simulate_training(job(64, 3), hosts=hosts, seed=0, compute=False, data=blobs, prefetch=False, **INSTANT)
        assert (r.staleness_summary()["mean"], r.sim_seconds, r.merges) == (mean, pytest.approx(seconds), 192)


def test_evaluations_delay_the_merges_behind_them(blobs: Dataset) -> None:
    """An evaluation after every pass holds the job's lease, so results wait longer; one every 1,000th
    merge (never here) changes nothing."""
    fast = run(blobs, merge_seconds=0.05, eval_seconds=0.0)
    evaluating = run(blobs, merge_seconds=0.05, eval_seconds=0.3)
    seldom = run(blobs, merge_seconds=0.05, eval_seconds=0.3, eval_every=1000)
    assert statistics.fmean(evaluating.merge_waits) > statistics.fmean(fast.merge_waits) + 0.1
    assert seldom.merge_waits == fast.merge_waits and seldom.passes == fast.passes


@pytest.mark.parametrize("processes", [1, 3])
def test_results_are_merged_each_exactly_once_in_order_of_arrival(blobs: Dataset, processes: int) -> None:
    r = run(
        blobs,
        hosts=6,
        speed_sigma=0.5,
        network_seconds=0.05,
        merge_seconds=0.2,
        eval_seconds=0.3,
        parameter_servers=processes,
    )
    assert r.longest_backlog > 0 and len(set(r.arrivals)) == len(r.arrivals)
    merged = set(r.merged)
    assert len(merged) == len(r.merged) == r.merges == 96
    assert r.merged == [a for a in r.arrivals if a in merged]


def test_a_pass_shares_its_cost_among_the_results_queued_behind_it(blobs: Dataset) -> None:
    """Passes of 1 s whatever they hold, results at about 4 a second: the queue that forms is taken
    a pass at a time, so the job needs far fewer than one second per merge, as one-merge passes would."""
    r = run(blobs, merge_seconds=0.0, eval_seconds=0.0, pass_seconds=1.0)
    one_each = run(blobs, merge_seconds=0.0, eval_seconds=0.0, pass_seconds=1.0, max_pass=1)
    assert r.merges == one_each.merges == 96
    assert statistics.fmean(r.passes) > 2 and max(r.passes) <= 8 and sum(r.passes) == 96
    assert one_each.passes == [1] * 96 and one_each.sim_seconds >= 96
    assert r.sim_seconds < 0.5 * one_each.sim_seconds


def test_more_processes_do_not_change_one_jobs_merges(blobs: Dataset) -> None:
    """One process holds a job's merge lease at a time: a second one serves other jobs, not this one."""
    one, three = (run(blobs, merge_seconds=0.1, eval_seconds=0.5, parameter_servers=p) for p in (1, 3))
    assert one.merge_waits == three.merge_waits and one.passes == three.passes
    assert one.sim_seconds == three.sim_seconds


def test_a_queued_result_is_not_timed_out_at_its_deadline(blobs: Dataset) -> None:
    """A deadline of 3 s, results waiting longer than that for their merge: uploaded, so none times
    out (the transitioner ends only assignments still in progress) and every one is merged."""
    r = run(blobs, merge_seconds=1.0, eval_seconds=0.0, timeout=3.0)
    assert max(r.merge_waits) > 3.0
    assert r.timeouts == 0 and r.late_results == 0 and r.merges == 96


def test_the_in_flight_budget_keeps_a_slow_merges_staleness_down(blobs: Dataset) -> None:
    """Merges of 1 s against results at about 4 a second: without the budget a backlog builds and every
    result in it waits; with the budget derived from the measured pace, dispatch holds back instead."""
    on, off = (run(blobs, merge_seconds=1.0, eval_seconds=0.0, backpressure=b) for b in (True, False))
    assert on.merges == off.merges == 96
    assert on.staleness_summary()["mean"] < 0.5 * off.staleness_summary()["mean"]
    assert on.longest_backlog < off.longest_backlog
