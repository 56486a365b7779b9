"""A finished job's final model, written after the transaction that ended it commits
(crowdtrain.server.ledger.epochs records the end): no object storage write holds the job's lock,
which on SQLite is the whole database's."""

import logging
from collections.abc import Callable

import redis
from sqlalchemy import and_, select, update
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys
from crowdtrain.core.experts import checkpoint_weights
from crowdtrain.core.jobspec import WORKUNIT_MODES
from crowdtrain.core.logs import ids
from crowdtrain.core.modelfile import model_metadata, with_metadata
from crowdtrain.core.refusals import NotFound
from crowdtrain.core.states import JobStatus
from crowdtrain.core.storage import ObjectNotFound, Storage
from crowdtrain.core.tensors import Params, TensorFormatError, decode, encode
from crowdtrain.server.ledger import experts
from crowdtrain.server.ledger.models import Job
from crowdtrain.server.paramstore import store

log = logging.getLogger(__name__)

# A job that ended with a model to export, not exported yet.
_EXPORT_DUE = and_(
    Job.mode.in_(WORKUNIT_MODES),
    Job.status.in_([JobStatus.succeeded.value, JobStatus.failed.value]),
    Job.finished_at.is_not(None),
    Job.final_key.is_(None),
)


def export_final_model(db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int) -> str | None:
    """Write the final model of an ended VC-ASGD job whose end is recorded but whose model is not yet
    exported, and record where (`final_key`); the key, None when the job has no final model (it has
    not ended, was cancelled, or failed before it ran). Idempotent: its merges are closed, so W_s no
    longer changes, and the file is the same whichever process writes it. The job's end calls it after
    its transaction commits; the transitioner calls it for a job whose process died in between
    (`export_pending_models`), and so does a download that comes first.

    The exported file is W_s's tensors as the parameter store holds them, byte for byte, under a
    header that says what they are (crowdtrain.core.modelfile): the version and the accuracy recorded
    when the job ended. A moe job's file adds its experts' weights from their last checkpoints
    (`with_experts`). NotFound for no such job."""
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        if job.final_key is not None or s.scalar(select(Job.id).where(Job.id == job_id, _EXPORT_DUE)) is None:
            return job.final_key
        name, spec, model_config, accuracy = job.name, job.spec, job.model_config_, job.final_accuracy
        status, message = job.status, job.status_message
    version, blob = store.read_blob(r, job_id)
    if "mixture" in model_config:
        blob = with_experts(db, storage, int(model_config["mixture"]), blob)
    key = keys.final_key(job_id)
    storage.put(key, with_metadata(blob, model_metadata(job_id, name, spec, model_config, version, accuracy)))
    with db.begin() as s:
        s.execute(update(Job).where(Job.id == job_id, Job.final_key.is_(None)).values(final_key=key))
    log.info("job %s %s: %s; final model v%d exported to %s", job_id, status, message, version, key)
    return key


def with_experts(db: sessionmaker[Session], storage: Storage, mixture_id: int, trunk: bytes) -> bytes:
    """A moe job's whole model: its trunk's tensors and each expert's weights from its newest checkpoint
    (expert/UID/NAME). An expert without a readable checkpoint is left out: it is at its initial
    weights, which the layout's seed in the file's header gives (crowdtrain.core.zoo_experts.build_expert)."""
    params = decode(trunk)
    params.update(mixture_weights(db, storage, mixture_id))
    return encode(params)


CheckpointReader = Callable[[Storage, int, str, str], Params]


def checkpoint_weights_at(storage: Storage, mixture_id: int, uid: str, key: str) -> Params:
    """The weights of expert `uid`'s checkpoint at `key` (expert/UID/NAME); none, logged, when it is not a
    checkpoint: the expert is then taken at its initial weights. Raises ObjectNotFound when `key` is gone."""
    try:
        return checkpoint_weights(uid, storage.get(key))
    except TensorFormatError as exc:
        log.warning("mixture %s: expert %s's checkpoint %s is unreadable (%s); left out", mixture_id, uid, key, exc)
        return {}


def mixture_weights(
    db: sessionmaker[Session], storage: Storage, mixture_id: int, read: CheckpointReader = checkpoint_weights_at
) -> Params:
    """The weights of every expert of the mixture that has a checkpoint, from its newest, read by `read`
    (a caching reader may stand in): what evaluation and the export use beside the trunk.

    A checkpoint gone when its bytes are read was replaced after its key was: a host's newer
    checkpoint deletes the one before it. The expert's key is read again and the newer one read (up to
    experts.KEY_READS keys); an expert whose checkpoint is gone and not replaced is left out, logged."""
    out: Params = {}
    due = experts.checkpoint_keys(db, mixture_id)
    for reads in range(1, experts.KEY_READS + 1):
        gone = {}
        for uid, key in due.items():
            try:
                out.update(read(storage, mixture_id, uid, key))
            except ObjectNotFound:
                gone[uid] = key
        newest = experts.checkpoint_keys(db, mixture_id) if gone and reads < experts.KEY_READS else {}
        due = {uid: newest[uid] for uid, key in gone.items() if newest.get(uid, key) != key}
        for uid in gone.keys() - due.keys():
            log.warning("mixture %s: expert %s's checkpoint %s is gone; left out", mixture_id, uid, gone[uid])
        if not due:
            break
    return out


def export_or_leave_it(db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int) -> None:
    """Export the model of a job whose end just committed; a failure (storage unreachable) is logged and
    left to the transitioner's next sweep (`export_pending_models`): the end stands either way."""
    try:
        export_final_model(db, storage, r, job_id)
    except Exception as exc:
        log.warning(
            "job %s: its final model could not be exported yet (%s: %s); the transitioner tries again",
            job_id,
            type(exc).__name__,
            exc,
            extra=ids(job_id=job_id),
        )


def export_pending_models(db: sessionmaker[Session], storage: Storage, r: redis.Redis) -> int:
    """Export the final model of every ended job whose export did not happen (its process died
    between the end's commit and the write); how many. For the transitioner."""
    with db.begin() as s:
        due = s.scalars(select(Job.id).where(_EXPORT_DUE)).all()
    for job_id in due:
        export_final_model(db, storage, r, job_id)
    return len(due)
