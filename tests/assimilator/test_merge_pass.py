"""A job's queue merged in passes under its merge lease, without Celery: a real SQLite ledger, file
storage and a private Redis, the results uploaded as the scheduler stores them (tests.assimilator.test_merge)."""

import json
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from sqlalchemy import select

from crowdtrain.assimilator.merge import TRANSIENT, MergeResult, MergeServices, Outcome
from crowdtrain.assimilator.merge_pass import merge_queued
from crowdtrain.assimilator.rules import make_rule, make_update
from crowdtrain.core import keys, merge_stages
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.tensors import Params
from crowdtrain.server.ledger.models import Metric
from crowdtrain.server.paramstore import store
from tests.assimilator.test_merge import Job, _assert_params_equal, _job, _moved

NESTEROV = {"rule": "delta", "outer_optimizer": "nesterov", "server_lr": 0.5, "outer_momentum": 0.9}


def _queue(services: MergeServices, results: int) -> tuple[Job, list[Params]]:
    """The job (outer Nesterov momentum: a rule with state) with `results` results uploaded, oldest first."""
    job = _job(services, results, **NESTEROV)
    clients = [_moved(job.w0, 0.01, seed=i) for i in range(results)]
    for a, client in zip(job.assignments, clients, strict=True):
        job.upload_weights(a, client)
    return job, clients


def _single_merges(job: Job, clients: list[Params]) -> tuple[Params, Params]:
    """W_s and the rule's state after merging `clients` one by one, in order, each started from W_s v0."""
    rule = make_rule(NESTEROV)
    server = {k: v.copy() for k, v in job.w0.items()}
    state = rule.initial_state(server)
    for staleness, client in enumerate(clients):
        rule.apply(server, state, make_update(job.w0, client, "weights", staleness, 1))
    return server, state


def _assert_merged_once(job: Job, clients: list[Params]) -> None:
    """Every result merged once, at versions 1..k in upload order; W_s and the rule's state as k single merges."""
    k = len(clients)
    assert [job.assignment(a)[:2] for a in job.assignments] == [
        (AssignmentStatus.merged.value, v) for v in range(1, k + 1)
    ]
    version, w_s, state = store.read_with_state(job.svc.r, job.job_id)
    assert version == k and job.svc.r.scard(keys.merged(job.job_id)) == k
    assert state is not None and int(state["step"]) == k, "one momentum step per result"
    expected_w_s, expected_state = _single_merges(job, clients)
    _assert_params_equal(w_s, expected_w_s)
    _assert_params_equal(state, expected_state)
    assert job.host() == (k, 0)
    assert job.credit(job.assignments[0])[0] == pytest.approx(sum(job.expected_credit(a) for a in job.assignments))


def _merge_log(job: Job) -> dict[int, dict]:
    return {int(a): json.loads(v) for a, v in job.svc.r.hgetall(keys.merge_log(job.job_id)).items()}


def test_a_task_merges_its_job_s_queue_in_one_pass_as_single_merges_would(services) -> None:
    """An epoch's four results queued: the first task merges them all, into W_s read once and written
    once (one commit), evaluates the version it wrote once, and the later tasks merge nothing again."""
    job, clients = _queue(services, 4)
    first, *others = job.assignments

    assert merge_queued(services, first, stamps=merge_stages.received()) == MergeResult(Outcome.merged, 1)

    _assert_merged_once(job, clients)
    assert len({entry["merged_at"] for entry in _merge_log(job).values()}) == 1, "one write of W_s"
    assert job.metrics() == 1, "the pass evaluates the version it wrote, not each merge"
    for a in others:
        assert merge_queued(services, a).outcome is Outcome.already_merged  # a late task records nothing new
    assert store.read(services.r, job.job_id)[0] == 4 and job.metrics() == 1


class _Scores:
    """An evaluator that gives every W_s the same figures and notes the job of each call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def evaluate(
        self, job_id: int, model_config: dict, params: Params, x: np.ndarray, y: np.ndarray
    ) -> tuple[float, float]:
        self.calls.append(job_id)
        return 1.25, 0.625


def test_the_pass_scores_w_s_with_the_evaluator_its_services_hold(services) -> None:
    """The evaluator is given once, in MergeServices: the pass scores the version it wrote with it, and
    the metric recorded is its figure."""
    scores = _Scores()
    services = replace(services, evaluator=scores)
    job, _ = _queue(services, 4)

    assert merge_queued(services, job.assignments[0], stamps=merge_stages.received()) == MergeResult(Outcome.merged, 1)

    assert scores.calls == [job.job_id], "one evaluation, for the version the pass wrote"
    with services.db.begin() as s:
        recorded = s.execute(select(Metric.param_version, Metric.val_loss, Metric.val_accuracy)).all()
    assert [tuple(row) for row in recorded] == [(4, 1.25, 0.625)]


def test_a_longer_queue_is_merged_in_passes_of_max_pass(services) -> None:
    """Eight results (two epochs), passes of three: three commits, in upload order, each epoch measured."""
    job, clients = _queue(services, 8)
    merge_queued(services, job.assignments[-1], max_pass=3)
    _assert_merged_once(job, clients)
    assert len({entry["merged_at"] for entry in _merge_log(job).values()}) == 3
    assert job.metrics() == 4  # a figure per pass and epoch: passes of v1-3, v4-6 (both epochs), v7-8


def test_a_task_that_finds_the_lease_held_returns_at_once_and_its_result_is_merged_by_the_holder(services) -> None:
    """Another process holds the job's merge lease: the task returns `queued` without waiting and merges
    nothing; the holder's next pass (here: the next task that gets the lease) merges its result."""
    job, clients = _queue(services, 2)
    first, second = job.assignments
    holder = services.r.lock(keys.merge_lease(job.job_id), timeout=30)
    assert holder.acquire(blocking=False)

    started = time.monotonic()
    assert merge_queued(services, second) == MergeResult(Outcome.queued)
    assert time.monotonic() - started < 1.0, "it did not wait for the lease"
    assert job.assignment(second)[0] == AssignmentStatus.uploaded.value
    assert services.r.exists(keys.merges_wanted(job.job_id)), "the holder will look for it"

    holder.release()
    assert merge_queued(services, first).outcome is Outcome.merged
    _assert_merged_once(job, clients)


def test_a_result_uploaded_while_the_holder_merges_is_merged_before_it_lets_go(services) -> None:
    """A result uploaded while another task's pass holds the lease: its own task returns at once
    (`queued`) or, if the holder let go meanwhile, merges it; either way it ends merged, and the lease free."""
    job = _job(services, 4, **NESTEROV)
    clients = [_moved(job.w0, 0.01, seed=i) for i in range(4)]
    *early, late = job.assignments
    for a, client in zip(early, clients[:-1], strict=True):
        job.upload_weights(a, client)
    holder = threading.Thread(target=merge_queued, args=(services, early[0]))
    holder.start()
    deadline = time.monotonic() + 30
    while not services.r.exists(keys.merge_lease(job.job_id)) and time.monotonic() < deadline:
        time.sleep(0.001)
    job.upload_weights(late, clients[-1])
    answer = merge_queued(services, late)
    holder.join(60)

    assert answer.outcome in (Outcome.queued, Outcome.merged)
    assert job.assignment(late)[0] == AssignmentStatus.merged.value
    assert store.read(services.r, job.job_id)[0] == 4 and services.r.scard(keys.merged(job.job_id)) == 4
    assert not services.r.exists(keys.merge_lease(job.job_id))


@pytest.mark.parametrize("tasks_per_result", [2, 3])
def test_redelivered_and_racing_tasks_merge_each_result_once_rule_state_included(services, tasks_per_result) -> None:
    """Three threads deliver every result's task `tasks_per_result` times between them, at once: each
    result is merged once, with one momentum step, and W_s is what single merges in upload order give."""
    job, clients = _queue(services, 6)
    deliveries = [a for a in job.assignments for _ in range(tasks_per_result)]
    errors: list[BaseException] = []

    def deliver(chunk: list[int]) -> None:
        try:
            for a in chunk:
                while True:
                    try:
                        merge_queued(services, a)
                        break
                    except TRANSIENT:  # the Celery task would be run again
                        time.sleep(0.01)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=deliver, args=(deliveries[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    _assert_merged_once(job, clients)
    assert not services.r.exists(keys.merge_lease(job.job_id)), "the lease was let go"
