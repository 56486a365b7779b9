"""Merges of jobs that no longer run are never queued again: cancelling or finishing a job ends its
unmerged results, uncharged. Real SQLite ledger, private Redis, local storage."""

from datetime import timedelta

import numpy as np
import pytest
import redis
from sqlalchemy import select

from crowdtrain.assimilator.evaluate import FrameworkEvaluator
from crowdtrain.core import keys
from crowdtrain.core.jobspec import JobSpec, load_job_spec
from crowdtrain.core.schemas import ResultMetrics
from crowdtrain.core.settings import Settings
from crowdtrain.core.states import AssignmentStatus, JobStatus
from crowdtrain.core.storage import open_storage
from crowdtrain.core.tensors import encode
from crowdtrain.launch.cluster import free_port, start_redis
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.job_end import close_merges, ending, reopen_abandoned_merges
from crowdtrain.server.ledger.models import Assignment, Host, Job, utcnow
from crowdtrain.server.paramstore import merging, store
from crowdtrain.server.services.dispatch import request_work
from crowdtrain.server.services.jobs import cancel_job
from crowdtrain.server.services.results import store_result
from crowdtrain.server.services.transitioner import (
    end_stalled_uploads,
    requeue_stalled_merges,
    sweep,
)
from crowdtrain.workgen.generator import submit_job
from tests.conftest import EXAMPLE_SPEC


def _small_job(var) -> JobSpec:
    """The example job on a small random dataset: quick to prepare."""
    rng = np.random.default_rng(0)
    labels = lambda n: np.arange(n) % 10  # noqa: E731
    np.savez(
        var / "small.npz",
        x=rng.standard_normal((200, 40)).astype(np.float32),
        y=labels(200),
        x_val=rng.standard_normal((50, 40)).astype(np.float32),
        y_val=labels(50),
    )
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.dataset.source = f"npz:{var / 'small.npz'}"
    return spec


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    var = tmp_path_factory.mktemp("transitioner")
    url = f"sqlite:///{var / 'crowdtrain.db'}"
    upgrade(url)
    redis_service = start_redis(var / "redis", port := free_port())
    try:
        yield session_factory(url), open_storage((var / "storage").as_uri()), redis.Redis(port=port), _small_job(var)
    finally:
        redis_service.stop()


@pytest.fixture
def uploaded(services):
    """A running example job (the only one) with one result uploaded whose merge task never ran."""
    db, storage, r, spec = services
    with db.begin() as s:
        earlier = s.scalars(select(Job.id).where(Job.status == JobStatus.running.value)).all()
    for job_id in earlier:  # out of the way (and their results with them)
        cancel_job(db, r, job_id)
    job_id = submit_job(db, storage, r, spec, Settings().upload_max_bytes).job_id
    with db.begin() as s:
        host = Host(name="alice", token_hash=f"{job_id:064d}")
        s.add(host)
        s.flush()
        host_id = host.id
    work = request_work(db, storage, host_id, 1, [], None)[0]
    body = encode(store.read(r, job_id)[1])
    store_result(db, storage, host_id, job_id, work.assignment_id, body, ResultMetrics(), enqueue=lambda *a: None)
    return db, r, job_id, work.assignment_id, host_id


def _merge(r, job_id: int, assignment_id: int) -> merging.MergeOutcome:
    """What a parameter server does to W_s for one result (the rule itself does not matter here)."""
    return merging.merge_once(r, job_id, assignment_id, lambda params, _state, _version: params)


def _requeued(db) -> list[int]:
    queued: list[int] = []
    requeue_stalled_merges(db, stalled_after=0, enqueue=lambda aid, _t: queued.append(aid), now=utcnow())
    return queued


def _ended_uncharged(db, assignment_id: int, host_id: int) -> str:
    with db.begin() as s:
        a = s.get_one(Assignment, assignment_id)
        assert a.status == AssignmentStatus.rejected.value
        assert s.get_one(Host, host_id).results_failed == 0, "the host was charged for the job's end"
        return a.message


def _end_stalled(db, r) -> tuple[int, list[int]]:
    queued: list[int] = []
    ended = end_stalled_uploads(db, r, stalled_after=0, enqueue=lambda aid, _t: queued.append(aid), now=utcnow())
    return ended, queued


def test_a_sweep_acts_at_the_time_it_is_given_so_nothing_waits_for_the_clock(services, uploaded) -> None:
    """Deadlines and stalled merges are judged at the sweep's `now`: at the clock's time an assignment
    just sent keeps running and a result just uploaded is not stalled; at a `now` past the deadline
    and past `stalled_after` (no sleeping) the one times out and the other is queued again."""
    db, storage, r, _ = services
    _, _, _, uploaded_id, host_id = uploaded
    (running,) = request_work(db, storage, host_id, 1, [], None)
    with db.begin() as s:
        deadline = s.get_one(Assignment, running.assignment_id).deadline
    queued: list[int] = []
    stalled = (60.0, lambda aid, _t: queued.append(aid))

    sweep(db, storage, r, FrameworkEvaluator(), utcnow(), stalled)
    with db.begin() as s:
        assert s.get_one(Assignment, running.assignment_id).status == AssignmentStatus.in_progress.value
    assert queued == []

    later = max(deadline, utcnow() + timedelta(seconds=60)) + timedelta(seconds=1)
    sweep(db, storage, r, FrameworkEvaluator(), later, stalled)
    with db.begin() as s:
        assert s.get_one(Assignment, running.assignment_id).status == AssignmentStatus.timed_out.value
    assert queued == [uploaded_id]


def test_a_stalled_merge_of_a_running_job_is_queued_again(uploaded) -> None:
    db, _, _, aid, _ = uploaded
    assert _requeued(db) == [aid]


def test_cancel_ends_unmerged_results_closes_merges_and_nothing_is_queued_again(uploaded) -> None:
    db, r, job_id, aid, host_id = uploaded
    version = int(r.get(keys.version(job_id)))
    cancel_job(db, r, job_id)
    assert "cancelled" in _ended_uncharged(db, aid, host_id)
    assert _requeued(db) == []
    with pytest.raises(merging.MergesClosed):  # a merge task still in flight cannot land now
        _merge(r, job_id, aid)
    assert int(r.get(keys.version(job_id))) == version and not r.sismember(keys.merged(job_id), aid)


def test_a_finished_jobs_stalled_results_are_ended_not_queued(uploaded) -> None:
    db, r, job_id, aid, host_id = uploaded
    with db.begin() as s:
        states.move(s.get_one(Job, job_id), JobStatus.succeeded)
    assert _requeued(db) == []
    assert _end_stalled(db, r) == (1, [])
    assert "ended before this result was merged" in _ended_uncharged(db, aid, host_id)
    assert _end_stalled(db, r) == (0, [])


def test_a_finished_jobs_result_that_w_s_holds_is_recorded_not_rejected(uploaded) -> None:
    """The parameter server merged it into W_s and died before the ledger said so; meanwhile the job
    ended. The result is queued again (its task records the merge), never rejected: DB and W_s agree."""
    db, r, job_id, aid, host_id = uploaded
    assert _merge(r, job_id, aid).applied_now
    with db.begin() as s:
        states.move(s.get_one(Job, job_id), JobStatus.succeeded)
    assert _end_stalled(db, r) == (0, [aid])
    with db.begin() as s:
        assert s.get_one(Assignment, aid).status == AssignmentStatus.uploaded.value


def test_a_job_end_that_does_not_commit_reopens_its_merges(uploaded) -> None:
    db, r, job_id, aid, _ = uploaded
    with pytest.raises(RuntimeError, match="commit failed"), ending(db, r) as s:
        close_merges(s, r, job_id)
        with pytest.raises(merging.MergesClosed):
            _merge(r, job_id, aid)
        raise RuntimeError("commit failed")
    assert _merge(r, job_id, aid).applied_now


def test_a_failed_transaction_on_a_job_that_no_longer_runs_leaves_its_merges_closed(uploaded) -> None:
    """Compensation follows the job's state: an ended job's merges stay closed whatever a later
    transaction that closed them again does (its W_s is exported)."""
    db, r, job_id, aid, _ = uploaded
    with db.begin() as s:
        states.move(s.get_one(Job, job_id), JobStatus.succeeded)
    with pytest.raises(RuntimeError, match="commit failed"), ending(db, r) as s:
        close_merges(s, r, job_id)
        raise RuntimeError("commit failed")
    with pytest.raises(merging.MergesClosed):
        _merge(r, job_id, aid)


def test_closing_merges_outside_an_ending_transaction_is_refused(uploaded) -> None:
    db, r, job_id, aid, _ = uploaded
    with pytest.raises(RuntimeError, match="ending"), db.begin() as s:
        close_merges(s, r, job_id)
    assert _merge(r, job_id, aid).applied_now


def test_the_sweep_reopens_the_merges_a_dead_process_left_closed_on_a_running_job_only(uploaded) -> None:
    """A process that died between closing a job's merges and its commit: no transaction is left to
    compensate, so the transitioner's sweep does, for running jobs (an ended job's stay closed)."""
    db, r, job_id, aid, _ = uploaded
    store.close_merges(r, job_id)  # what the dead process did before its transaction was lost
    assert reopen_abandoned_merges(db, r) == 1
    assert reopen_abandoned_merges(db, r) == 0
    assert _merge(r, job_id, aid).applied_now
    with db.begin() as s:
        states.move(s.get_one(Job, job_id), JobStatus.failed)
    store.close_merges(r, job_id)
    assert reopen_abandoned_merges(db, r) == 0 and store.merges_closed(r, job_id)
