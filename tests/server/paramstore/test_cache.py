"""A parameter-server process holds the W_s of its most recently merged jobs only."""

import numpy as np
import pytest

from crowdtrain.core.tensors import encode
from crowdtrain.server.paramstore import cache


@pytest.fixture(autouse=True)
def empty_cache():
    cache.clear()
    yield
    cache.clear()


def _model(tag: str) -> cache.CachedModel:
    return cache.CachedModel.of(tag, 1, encode({"w": np.zeros(4, dtype=np.float32)}), None, None)


def test_the_least_recently_merged_job_is_let_go_beyond_jobs_held() -> None:
    jobs = range(1, cache.JOBS_HELD + 2)
    for job_id in jobs:
        cache.keep(job_id, _model(f"t{job_id}"))
    assert cache.take(1, "t1") is None  # the first job, merged longest ago, was let go
    for job_id in jobs[1:]:
        assert cache.take(job_id, f"t{job_id}") is not None


def test_a_job_merged_again_is_kept_before_the_others() -> None:
    for job_id in range(1, cache.JOBS_HELD + 1):
        cache.keep(job_id, _model(f"t{job_id}"))
    cache.keep(1, cache.take(1, "t1"))  # job 1 merges again: now the most recent
    cache.keep(99, _model("t99"))
    assert cache.take(2, "t2") is None
    assert cache.take(1, "t1") is not None
