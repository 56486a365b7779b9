"""The Celery application of the parameter servers. Importing it is cheap (no torch)."""

from celery import Celery

from crowdtrain.core import keys
from crowdtrain.core.merge_stages import Stamps
from crowdtrain.core.settings import get_settings

ASSIMILATE_TASK = "crowdtrain.assimilate"


def make_celery() -> Celery:
    settings = get_settings()
    app = Celery("crowdtrain", broker=settings.redis_url, include=["crowdtrain.assimilator.worker.tasks"])
    app.conf.update(
        task_default_queue=keys.ASSIMILATE_QUEUE,
        task_ignore_result=True,
        # A task is acknowledged only after it ran, and redelivered if its worker died: merges are
        # idempotent (see paramstore.merging.merge_batch), so "at least once" delivery is safe.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": settings.broker_visibility_timeout},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


celery_app = make_celery()


def enqueue_merge(assignment_id: int, stamps: Stamps) -> None:
    """Queue the merge of one uploaded result, with its stamps so far; may be called more than once for the same id."""
    celery_app.send_task(ASSIMILATE_TASK, args=[assignment_id, stamps], task_id=f"assimilate-{assignment_id}")
