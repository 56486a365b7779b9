"""Turn a job spec into a running job: shards in storage, W_s version 0, and epoch workunits."""

import logging
from dataclasses import dataclass

import numpy as np
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from assimilator import paramstore
from crowdtrain.frameworks import KERAS_MODEL
from crowdtrain.jobspec import VC_ASGD, JobSpec
from crowdtrain.storage import Storage
from crowdtrain.tensors import Params, decode_shard, encode, encode_shard, manifest_of, sha256
from crowdtrain.zoo import build_model, check_model, count_parameters, state_to_numpy
from server import states
from server.models import Job, Shard, Workunit, utcnow
from server.states import JobStatus, WorkunitStatus
from workgen.datasets import deal_shards, load_dataset

log = logging.getLogger(__name__)


def snapshot_key(job_id: int, version: int) -> str:
    return f"jobs/{job_id}/snapshots/v{version:08d}.safetensors"


def shard_key(job_id: int, epoch: int, index: int) -> str:
    """Epoch 0 (the deal every epoch shares) keeps the layout of jobs from before re-dealing."""
    if epoch == 0:
        return f"jobs/{job_id}/shards/{index:05d}.npz"
    return f"jobs/{job_id}/shards/e{epoch:05d}/{index:05d}.npz"


@dataclass(frozen=True)
class PreparedJob:
    job_id: int
    shards: int
    parameters: int


def submit_job(db: sessionmaker[Session], storage: Storage, r: redis.Redis, spec: JobSpec,
               upload_max_bytes: int) -> PreparedJob:
    """Create a job and its first epoch.

    A spec that could only give a stuck or silently wrong job (a bad dataset, a model that cannot
    take its examples or whose parameters exceed `upload_max_bytes`, the largest upload the
    scheduler accepts) raises ValueError naming the field and the problem, before anything is stored.
    """
    data = load_dataset(spec.dataset.source, spec.dataset.validation_fraction, spec.dataset.classes)
    dealt = deal_shards(data.y, spec.dataset.subsets, spec.dataset.shuffle, spec.seed)
    model_config = {"name": spec.model.name, "framework": spec.framework, "input_shape": data.input_shape,
                    "num_classes": data.num_classes, "options": spec.model.options}
    if spec.model.keras is not None:
        model_config["keras"] = spec.model.keras
    params, n_parameters = initial_parameters(model_config, spec.seed, upload_max_bytes)
    initial = encode(params)
    if len(initial) > upload_max_bytes:
        raise ValueError(f"model: its parameters take {len(initial):,} bytes, more than the scheduler accepts in "
                         f"one upload ({upload_max_bytes:,} bytes, upload_max_bytes)")

    with db.begin() as s:
        job = Job(name=spec.name, mode=spec.mode, status=JobStatus.pending.value, spec=spec.model_dump(mode="json"),
                  model_config_=model_config, param_manifest=manifest_of(params), param_bytes=len(initial))
        s.add(job)
        s.flush()
        job_id = job.id

    try:
        shard_rows = []
        for index, picked in enumerate(dealt):
            blob = encode_shard(data.x[picked], data.y[picked])
            key = shard_key(job_id, 0, index)
            storage.put(key, blob)
            shard_rows.append(Shard(job_id=job_id, epoch=0, index=index, key=key, sha256=sha256(blob),
                                    size=len(blob), examples=len(picked)))
        validation_key = f"jobs/{job_id}/validation.npz"
        storage.put(validation_key, encode_shard(data.x_val, data.y_val))
        storage.put(snapshot_key(job_id, 0), initial)
        paramstore.initialise(r, job_id, params)
        paramstore.note_snapshot(r, job_id, 0, keep=1_000_000)
    except Exception as exc:
        with db.begin() as s:
            job = s.get_one(Job, job_id)
            job.status_message = f"preparing the job failed: {exc}"
            states.move(job, JobStatus.failed)
        raise

    with db.begin() as s:
        job = s.get_one(Job, job_id)
        s.add_all(shard_rows)
        job.validation_key = validation_key
        job.snapshot_version, job.snapshot_key, job.snapshot_sha256 = 0, snapshot_key(job_id, 0), sha256(initial)
        job.snapshot_at = job.started_at = utcnow()
        states.move(job, JobStatus.running)
        s.flush()
        if spec.mode == VC_ASGD:  # dedloc peers need no workunits: server.dedloc runs their rounds
            release_epoch(s, job, 1)
    log.info("job %s (%s, %s): %d shards, %d parameters, running", job_id, spec.name, spec.mode, len(dealt),
             n_parameters)
    return PreparedJob(job_id, len(dealt), n_parameters)


def initial_parameters(model_config: dict, seed: int, max_bytes: int) -> tuple[Params, int]:
    """W_s version 0 in the canonical layout, and the number of trainable parameters.

    Zoo models start from the PyTorch zoo whatever the job's framework (its layout is canonical),
    once `check_model` has seen, without allocating them, that they take the dataset's examples
    and fit in `max_bytes`. A Keras JSON model is built in safe mode, which refuses Lambda layers
    and other code, and checked for its input and output shapes.
    """
    if model_config["name"] != KERAS_MODEL:
        check_model(model_config["name"], model_config["input_shape"], model_config["num_classes"],
                    model_config["options"], max_bytes)
        model = build_model(model_config["name"], model_config["input_shape"], model_config["num_classes"],
                            seed=seed, **model_config["options"])
        return state_to_numpy(model), count_parameters(model)
    from crowdtrain.zoo_keras import build_model as build_keras_model

    try:
        keras_model = build_keras_model(model_config, seed=seed)
    except ImportError:
        raise ValueError("this server cannot load Keras JSON models: install crowdtrain[tensorflow]") from None
    trainable = sum(int(np.prod(v.shape)) for v in keras_model.model.trainable_weights)
    return keras_model.get_params(), trainable


def release_epoch(s: Session, job: Job, epoch: int) -> bool:
    """Create one ready workunit per shard for `epoch`; idempotent (False if already released).

    A job that re-deals its examples each epoch (`dataset.reshuffle_each_epoch`) gets shard rows of
    its own for every epoch from 2 on (epoch 1 uses the deal made at submission); their bytes are
    written when first dispatched (`write_epoch_shards`), not here, in the job's locked transaction.

    Only VC-ASGD jobs have workunits: releasing an epoch of another mode raises ValueError, so that
    no path (dispatch, epoch closing, a repair) can hand a DeDLOC job's shards out as VC-ASGD work.
    """
    if job.mode != VC_ASGD:
        raise ValueError(f"job {job.id} runs in mode {job.mode!r}: only {VC_ASGD} jobs have epochs of workunits")
    if job.current_epoch >= epoch:
        return False
    shard_ids = s.scalars(select(Shard.id).where(Shard.job_id == job.id, Shard.epoch == 0)
                          .order_by(Shard.index)).all()
    if epoch >= 2 and job.spec["dataset"].get("reshuffle_each_epoch"):
        own = [Shard(job_id=job.id, epoch=epoch, index=i, key=shard_key(job.id, epoch, i), sha256=None, size=0,
                     examples=0) for i in range(len(shard_ids))]
        s.add_all(own)
        s.flush()
        shard_ids = [sh.id for sh in own]
    s.add_all(Workunit(job_id=job.id, epoch=epoch, shard_id=sid, status=WorkunitStatus.ready.value)
              for sid in shard_ids)
    job.current_epoch = epoch
    log.info("job %s: epoch %d released (%d workunits)", job.id, epoch, len(shard_ids))
    return True


def write_epoch_shards(s: Session, storage: Storage, job: Job, epoch: int) -> int:
    """Write the re-dealt shards of `epoch` to storage and record their hashes; 0 if already written.

    The examples are those of the job's epoch-0 shards, dealt anew with the job's
    `dataset.shuffle` and the seed (job seed, epoch). Call it in the transaction that hands one of
    them out: the shard rows are locked and checked again first, so concurrent dispatchers write
    them once (a rolled-back writer leaves only bytes that the next one overwrites). Returns the
    number of shards written.
    """
    # populate_existing: rows this session loaded before the lock may have been written since.
    rows = s.scalars(select(Shard).where(Shard.job_id == job.id, Shard.epoch == epoch).order_by(Shard.index)
                     .with_for_update().execution_options(populate_existing=True)).all()
    if not rows or all(sh.sha256 is not None for sh in rows):
        return 0
    shared = s.scalars(select(Shard).where(Shard.job_id == job.id, Shard.epoch == 0).order_by(Shard.index)).all()
    parts = [decode_shard(storage.get(sh.key)) for sh in shared]
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    dataset = job.spec["dataset"]
    # A job submitted before dataset.shuffle existed has no such field: it gets the default.
    for sh, picked in zip(rows, deal_shards(y, len(rows), dataset.get("shuffle", "stratified"),
                                                 job.spec["seed"], epoch)):
        blob = encode_shard(x[picked], y[picked])
        storage.put(sh.key, blob)
        sh.sha256, sh.size, sh.examples = sha256(blob), len(blob), len(picked)
    s.flush()
    log.info("job %s: epoch %d's %d shards dealt anew and written", job.id, epoch, len(rows))
    return len(rows)


def next_epoch_releasable(s: Session, job: Job, ignore_ready: bool = False) -> bool:
    """Early release: the current epoch has nothing left to dispatch and no older epoch is still open.

    `ignore_ready` is for a caller that has already seen every ready workunit claimed by others.
    Never for a job of another mode than VC-ASGD (see `release_epoch`).
    """
    if job.mode != VC_ASGD:
        return False
    if job.status != JobStatus.running.value or job.current_epoch >= job.spec["stop"]["max_epochs"]:
        return False
    ready = 0 if ignore_ready else s.scalar(select(func.count()).select_from(Workunit).where(
        Workunit.job_id == job.id, Workunit.epoch == job.current_epoch, Workunit.status == WorkunitStatus.ready.value))
    older_open = s.scalar(select(func.count()).select_from(Workunit).where(
        Workunit.job_id == job.id, Workunit.epoch < job.current_epoch,
        Workunit.status.in_([WorkunitStatus.ready.value, WorkunitStatus.in_progress.value])))
    return ready == 0 and older_open == 0


