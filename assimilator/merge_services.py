"""What a merge works with (MergeServices), and the two kinds of failure every step of it tells apart:
transient ones, which a retry removes, and a broken job, which every merge of the job would meet."""

from dataclasses import dataclass, field

import redis
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.evaluate import FrameworkEvaluator
from crowdtrain.assimilator.expert_weights import ExpertCheckpoints
from crowdtrain.core.settings import Settings
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.paramstore import store

# Failures that go away (a lost database race or connection, Redis unreachable): `assimilate` raises
# them for its caller to run it again. Any other failure ends the assignment (see `_failed`).
TRANSIENT = (OperationalError, redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)


class JobBroken(Exception):
    """The job itself cannot take merges (its validation set does not fit its model, ...): every
    merge would fail the same way, so the job fails with this message."""


@dataclass(frozen=True)
class MergeServices:
    """What a merge works with: the ledger, object storage, Redis (W_s), the snapshots to keep, and
    what scores W_s on a job's validation set (this process's one evaluator)."""

    db: sessionmaker[Session]
    storage: Storage
    r: redis.Redis
    snapshots_kept: int
    evaluator: Evaluator = field(default_factory=FrameworkEvaluator)

    @classmethod
    def from_settings(cls, settings: Settings) -> "MergeServices":
        db = session_factory(settings.resolved_database_url)
        storage = open_storage(settings.resolved_storage_url, settings.s3_endpoint_url)
        return cls(
            db,
            storage,
            store.connect(settings.redis_url),
            settings.snapshots_kept,
            FrameworkEvaluator(ExpertCheckpoints(db, storage)),
        )
