"""Backpressure on a real ledger (SQLite and PostgreSQL) and a private Redis: a job's assignments
dispatched or uploaded but not merged never pass its in-flight budget, other jobs are served while
it waits, dispatch resumes as merges land, and the derived budget follows the merge pace the ledger
measured."""

import math
from collections import Counter
from datetime import timedelta

import pytest

from crowdtrain.assimilator.merge import Outcome
from crowdtrain.core.schemas import AssignmentOut
from crowdtrain.core.storage import open_storage
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.merges import record_merge
from crowdtrain.server.ledger.models import Assignment, Job, utcnow
from crowdtrain.server.services.backpressure import BudgetTerms, in_flight_budget
from crowdtrain.server.services.dispatch import request_work
from crowdtrain.server.services.jobs import job_status
from tests.server.services.test_scheduling import BOTH_DATABASES, Ledger


@pytest.fixture
def ledger(database_url, private_redis, tmp_path) -> Ledger:
    upgrade(database_url)
    return Ledger(session_factory(database_url), open_storage((tmp_path / "storage").as_uri()), private_redis, tmp_path)


def work(ledger: Ledger, host_id: int, free_slots: int) -> list[AssignmentOut]:
    return request_work(ledger.db, ledger.storage, host_id, free_slots, [], None)


@BOTH_DATABASES
def test_dispatch_stops_at_the_budget_and_resumes_after_a_merge(ledger) -> None:
    """Prefetched (in progress) and uploaded-unmerged assignments both count; a merge frees one place."""
    job = ledger.submit(subsets=8, max_in_flight=3)
    (host,) = ledger.hosts(1)
    given = work(ledger, host, 5)  # a client with 4 slots asks for one more, its prefetch
    assert len(given) == 3
    assert work(ledger, host, 2) == []
    ledger.upload(host, job, given[0].assignment_id)
    assert work(ledger, host, 2) == [], "an uploaded result is in flight until it is merged"
    assert ledger.merge(given[0].assignment_id) == Outcome.merged
    again = work(ledger, host, 2)
    assert len(again) == 1 and again[0].workunit_id not in {a.workunit_id for a in given}
    assert work(ledger, host, 2) == []
    status = job_status(ledger.db, job).in_flight
    assert status is not None and (status.count, status.budget, status.derived, status.held_back) == (3, 3, False, True)


@BOTH_DATABASES
def test_a_job_at_its_budget_leaves_the_slots_to_another_job(ledger) -> None:
    """Fair share would split 6 slots 3:3; the held job takes its 2 and the other the rest."""
    held = ledger.submit(subsets=8, max_in_flight=2)
    other = ledger.submit(subsets=8)
    (host,) = ledger.hosts(1)
    assert Counter(a.job_id for a in work(ledger, host, 6)) == {held: 2, other: 4}
    assert Counter(a.job_id for a in work(ledger, host, 2)) == {other: 2}


ROUNDS_OF_3 = {"rule": "fedbuff", "buffer_size": 3, "outer_optimizer": "nesterov", "server_lr": 0.7}


@BOTH_DATABASES
def test_a_job_in_rounds_dispatches_each_round_from_the_snapshot_that_ended_the_last(ledger) -> None:
    """Rounds of 3: the prefetch included, 3 go out from W_s 0; merged results wait in the buffer and
    still hold their places, so nothing more goes out until the third is merged; then the next 3 go
    out from the snapshot of version 3, which the round's outer step made."""
    job = ledger.submit(subsets=8, assimilation=ROUNDS_OF_3, rounds=True)
    (host,) = ledger.hosts(1)
    first = work(ledger, host, 5)
    assert [a.base_version for a in first] == [0, 0, 0]
    for n, a in enumerate(first, start=1):
        assert work(ledger, host, 2) == []
        ledger.upload(host, job, a.assignment_id)
        assert ledger.merge(a.assignment_id) == Outcome.merged
        status = job_status(ledger.db, job).in_flight
        if n < 3:
            assert status is not None and (status.count, status.budget, status.derived, status.held_back) == (
                3 - n,
                3 - n,
                False,
                True,
            ), "a buffered result keeps its place in the round"
    second = work(ledger, host, 5)
    assert [a.base_version for a in second] == [3, 3, 3]
    assert {a.workunit_id for a in second}.isdisjoint(a.workunit_id for a in first)
    with ledger.db.begin() as s:
        assert s.get_one(Job, job).snapshot_version == 3, "only the round's end is published"


def test_the_derived_budget_is_merge_rate_times_turnaround_plus_hosts() -> None:
    """The pure formula: the spec's value when set; else max(rule floor, ceil(r x t) + hosts); before
    any pace, none."""
    derived = BudgetTerms(max_in_flight=None, rule_floor=1)
    assert in_flight_budget(derived, 0.5, 7.5, 1) == 5
    assert in_flight_budget(derived, 0.01, 7.5, 1) == 2  # one per host beyond the pipeline, never 0
    assert in_flight_budget(derived, 0.01, 7.5, 0) == 1
    assert in_flight_budget(derived, None, None, 3) is None
    assert in_flight_budget(BudgetTerms(None, 8), 0.1, 1.0, 1) == 8  # fedbuff's buffer
    assert in_flight_budget(BudgetTerms(7, 8), 100.0, 100.0, 9) == 7
    assert in_flight_budget(BudgetTerms(7, 1), None, None, 0) == 7
    assert BudgetTerms.of({"assimilation": {"rule": "fedbuff", "buffer_size": 6}}) == BudgetTerms(None, 6)
    assert BudgetTerms.of({"scheduling": {"max_in_flight": 4}}) == BudgetTerms(4, 1)
    rounds = BudgetTerms.of({"assimilation": {"rule": "fedbuff", "buffer_size": 8}, "scheduling": {"rounds": True}})
    assert rounds == BudgetTerms(None, 8, 8)
    assert [in_flight_budget(rounds, 0.1, 1.0, 5, version) for version in (0, 1, 7, 8, 13)] == [8, 7, 1, 8, 3]


@BOTH_DATABASES
def test_the_default_budget_follows_the_merge_pace_the_ledger_recorded(ledger) -> None:
    """Three merges 2 s apart (0.5 merges/s) of results that took 6, 7.5 and 10 s from dispatch to
    upload (median 7.5): the budget is ceil(0.5 x 7.5) + 1 host = 5. The host holding the job's 5
    unmerged assignments gets no more; a host holding none gets one, which raises the budget to 6."""
    job = ledger.submit(subsets=16)
    first, second = ledger.hosts(2)
    given = work(ledger, first, 8)
    assert len(given) == 8, "before any merge there is no budget"
    status = job_status(ledger.db, job).in_flight
    assert status is not None and (status.count, status.budget, status.held_back) == (8, None, False)
    t0 = utcnow() - timedelta(seconds=100)
    for i, (took, merged_after) in enumerate([(6.0, 10.0), (7.5, 12.0), (10.0, 14.0)]):
        aid = given[i].assignment_id
        ledger.upload(first, job, aid)
        with ledger.db.begin() as s:
            a = s.get_one(Assignment, aid)
            a.sent_at, a.uploaded_at = t0, t0 + timedelta(seconds=took)
        record_merge(ledger.db, aid, i + 1, now=t0 + timedelta(seconds=merged_after))
    with ledger.db.begin() as s:
        pace = s.get_one(Job, job)
        assert pace.merge_rate == pytest.approx(0.5) and pace.turnaround_seconds == pytest.approx(7.5)
    expected = math.ceil(0.5 * 7.5) + 1
    status = job_status(ledger.db, job).in_flight
    assert status is not None
    assert (status.count, status.budget, status.derived, status.held_back) == (5, expected, True, True)
    assert (status.merge_rate, status.turnaround_seconds) == (pytest.approx(0.5), pytest.approx(7.5))
    assert work(ledger, first, 4) == []
    assert len(work(ledger, second, 4)) == 1, "a host holding none of the job's work may get one"
    assert work(ledger, second, 4) == []
    status = job_status(ledger.db, job).in_flight
    assert status is not None and (status.count, status.budget, status.held_back) == (6, expected + 1, True)
