"""Merges of jobs that no longer run are never queued again: cancelling or finishing a job ends its
unmerged results, uncharged. Real SQLite ledger, private Redis, local storage."""

import numpy as np
import pytest
import redis
from sqlalchemy import select

from crowdtrain.jobspec import JobSpec, load_job_spec
from crowdtrain.launch import free_port, start_redis
from crowdtrain.schemas import ResultMetrics
from crowdtrain.settings import Settings
from crowdtrain.storage import open_storage
from crowdtrain.tensors import encode
from assimilator import paramstore
from migrations import upgrade
from server import states
from server.db import session_factory
from server.dispatch import request_work
from server.jobs import cancel_job
from server.models import Assignment, Host, Job
from server.results import store_result
from server.states import AssignmentStatus, JobStatus
from server.transitioner import end_stalled_uploads, requeue_stalled_merges
from tests.conftest import EXAMPLE_SPEC
from workgen.generator import submit_job


def _small_job(var) -> JobSpec:
    """The example job on a small random dataset: quick to prepare."""
    rng = np.random.default_rng(0)
    labels = lambda n: np.arange(n) % 10  # noqa: E731
    np.savez(var / "small.npz", x=rng.standard_normal((200, 40)).astype(np.float32), y=labels(200),
             x_val=rng.standard_normal((50, 40)).astype(np.float32), y_val=labels(50))
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
        cancel_job(db, job_id)
    job_id = submit_job(db, storage, r, spec, Settings().upload_max_bytes).job_id
    with db.begin() as s:
        host = Host(name="alice", token_hash=f"{job_id:064d}")
        s.add(host)
        s.flush()
        host_id = host.id
    work = request_work(db, storage, host_id, 1, [], None)[0]
    body = encode(paramstore.read(r, job_id)[1])
    store_result(db, storage, host_id, job_id, work.assignment_id, body, ResultMetrics(), enqueue=lambda *a: None)
    return db, job_id, work.assignment_id, host_id


def _requeued(db) -> list[int]:
    queued: list[int] = []
    requeue_stalled_merges(db, stalled_after=0, enqueue=lambda aid, _t: queued.append(aid))
    return queued


def _ended_uncharged(db, assignment_id: int, host_id: int) -> str:
    with db.begin() as s:
        a = s.get_one(Assignment, assignment_id)
        assert a.status == AssignmentStatus.rejected.value
        assert s.get_one(Host, host_id).results_failed == 0, "the host was charged for the job's end"
        return a.message


def test_a_stalled_merge_of_a_running_job_is_queued_again(uploaded) -> None:
    db, _, aid, _ = uploaded
    assert _requeued(db) == [aid]


def test_cancel_ends_unmerged_results_and_nothing_is_queued_again(uploaded) -> None:
    db, job_id, aid, host_id = uploaded
    cancel_job(db, job_id)
    assert "cancelled" in _ended_uncharged(db, aid, host_id)
    assert _requeued(db) == []


def test_a_finished_jobs_stalled_results_are_ended_not_queued(uploaded) -> None:
    db, job_id, aid, host_id = uploaded
    with db.begin() as s:
        states.move(s.get_one(Job, job_id), JobStatus.succeeded)
    assert _requeued(db) == []
    assert end_stalled_uploads(db, stalled_after=0) == 1
    assert "ended before this result was merged" in _ended_uncharged(db, aid, host_id)
    assert end_stalled_uploads(db, stalled_after=0) == 0
