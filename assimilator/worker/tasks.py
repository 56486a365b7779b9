"""The Celery task of a parameter server: merge one uploaded result into W_s, with its job's queue.

A shell around crowdtrain.assimilator.merge_pass.merge_queued, which holds the whole procedure and
its guarantee (merged exactly once; may be delivered twice): the task that gets the job's merge
lease merges what the job has queued, one that finds it held returns at once. Delivery is at least
once (late acks, redelivery when a worker dies). A transient failure (a lost database race or connection, Redis
unreachable) runs the task again, with backoff; any other failure the merge itself records.
"""

import logging
from functools import lru_cache

# A parameter server evaluates W_s after its merges: the PyTorch back-end of evaluation (and torch)
# is imported here, once, before the worker forks its processes, not by each of them on its first
# evaluation as a process that seldom evaluates (a scheduler worker) does.
from crowdtrain.assimilator import logits_pytorch, merge, merge_pass  # noqa: F401
from crowdtrain.assimilator.worker.celery_app import ASSIMILATE_TASK, celery_app
from crowdtrain.core import merge_stages
from crowdtrain.core.settings import get_settings

log = logging.getLogger(__name__)


@lru_cache
def _services() -> merge.MergeServices:
    """Built once per worker process: its database engine, storage client and Redis connection pool."""
    return merge.MergeServices.from_settings(get_settings())


@celery_app.task(
    name=ASSIMILATE_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=merge.TRANSIENT,
    retry_backoff=0.5,
    max_retries=10,
)
def assimilate(assignment_id: int, stamps: merge_stages.Stamps | float | None = None) -> None:
    """`stamps`: the result's merge stages so far (crowdtrain.core.merge_stages); a task an older
    scheduler queued carries the time its body was in hand instead."""
    timed = merge_stages.of_task(stamps)
    merge_stages.stamp(timed, "started")
    result = merge_pass.merge_queued(_services(), assignment_id, timed)
    log.debug("assignment %s: %s (v%s) %s", assignment_id, result.outcome, result.version, result.reason)


__all__ = ["assimilate"]
