"""A parameter-server process holds the W_s of its most recently merged jobs only."""

import numpy as np
import pytest

from crowdtrain.core.tensors import encode
from crowdtrain.server.ledger import w_s_cache


@pytest.fixture(autouse=True)
def empty_cache():
    w_s_cache.clear()
    yield
    w_s_cache.clear()


def _model(tag: str) -> w_s_cache.CachedModel:
    return w_s_cache.CachedModel.of(tag, 1, encode({"w": np.zeros(4, dtype=np.float32)}), None, None)


def test_the_least_recently_merged_job_is_let_go_beyond_jobs_held() -> None:
    jobs = range(1, w_s_cache.JOBS_HELD + 2)
    for job_id in jobs:
        w_s_cache.keep(job_id, _model(f"t{job_id}"))
    assert w_s_cache.take(1, "t1") is None  # the first job, merged longest ago, was let go
    for job_id in jobs[1:]:
        assert w_s_cache.take(job_id, f"t{job_id}") is not None


def test_a_job_merged_again_is_kept_before_the_others() -> None:
    for job_id in range(1, w_s_cache.JOBS_HELD + 1):
        w_s_cache.keep(job_id, _model(f"t{job_id}"))
    w_s_cache.keep(1, w_s_cache.take(1, "t1"))  # job 1 merges again: now the most recent
    w_s_cache.keep(99, _model("t99"))
    assert w_s_cache.take(2, "t2") is None
    assert w_s_cache.take(1, "t1") is not None
