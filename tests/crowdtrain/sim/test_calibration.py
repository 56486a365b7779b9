"""The simulator's timing read from a real job's merge log: passes grouped by their write, and a
pass's service time fitted over the passes that started with a backlog; the spread of the hosts'
speeds and of one host's assignments."""

import math

import numpy as np
import pytest

from crowdtrain.sim.calibration import MIN_BACKLOGGED, _fit_passes, _Pass, _passes, _spreads


def test_the_merge_log_is_grouped_into_passes_by_their_write() -> None:
    log = [
        {"version": 2, "received_at": 9.5, "merged_at": 10.0},
        {"version": 1, "received_at": 9.0, "merged_at": 10.0},
        {"version": 3, "received_at": 10.5, "merged_at": 11.0},
        {"version": 4, "received_at": None},  # written by a pass whose log entry is not complete
    ]
    assert _passes(log) == [_Pass(10.0, [1, 2], 9.0), _Pass(11.0, [3], 10.5)]


def backlogged(sizes: list[int], fixed: float, each: float, eval_seconds: float = 0.0) -> list[_Pass]:
    """Passes one after the other, each one's first result arrived before the previous wrote."""
    passes, t, version = [], 0.0, 0
    for k in sizes:
        t += fixed + each * k + eval_seconds
        versions = list(range(version + 1, version + k + 1))
        version += k
        passes.append(_Pass(t, versions, t - 10.0))
    return passes


def test_a_passes_cost_and_each_results_are_recovered_from_backlogged_passes() -> None:
    passes = backlogged([1, 3, 2, 5, 8, 4, 6], fixed=0.04, each=0.015, eval_seconds=0.1)
    evaluated = {p.versions[-1] for p in passes}  # every pass evaluated: its time is taken off
    fixed, each, rows = _fit_passes(passes, 0.1, evaluated)
    assert rows == 6 and fixed == pytest.approx(0.04) and each == pytest.approx(0.015)


def test_passes_that_waited_for_their_results_measure_nothing() -> None:
    passes = backlogged([1, 2, 3, 4, 5, 6, 7], fixed=0.04, each=0.015)
    waited = [_Pass(p.written_at, p.versions, p.written_at - 0.001) for p in passes]  # arrived after the write before
    assert _fit_passes(waited, 0.0, set()) == (None, None, 0)
    few = backlogged([1, 2, 3], fixed=0.04, each=0.015)
    assert len(few) - 1 < MIN_BACKLOGGED and _fit_passes(few, 0.0, set())[:2] == (None, None)


def test_the_spread_between_hosts_and_within_a_host_are_told_apart() -> None:
    """Hosts 1.0, 2.0 and 0.5 times as slow, each assignment a further lognormal(0, 0.3) draw: the
    hosts' spread is that of their logarithms (ln 2 = 0.69), the assignments' the 0.3 within."""
    rng = np.random.default_rng(0)
    rates = [list(factor * 1e-3 * rng.lognormal(0.0, 0.3, 400)) for factor in (1.0, 2.0, 0.5)]
    speed_sigma, jitter_sigma = _spreads(rates)
    assert speed_sigma == pytest.approx(math.log(2), rel=0.05)
    assert jitter_sigma == pytest.approx(0.3, rel=0.05)


def test_one_result_per_host_measures_no_jitter_and_one_host_no_spread() -> None:
    assert _spreads([[1e-3], [2e-3]]) == (pytest.approx(math.log(2) / math.sqrt(2)), 0.0)
    assert _spreads([[1e-3, 1e-3, 1e-3]]) == (0.0, 0.0)
