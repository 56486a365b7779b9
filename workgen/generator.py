"""Turn a job spec into a running job (shards in storage, W_s version 0; the ledger records it and
releases its first epoch), and write the shards of epochs that re-deal their examples."""

import importlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys, signing
from crowdtrain.core.assimilationspec import effective_rule
from crowdtrain.core.frameworks import KERAS_MODEL
from crowdtrain.core.jobspec import WORKUNIT_MODES, JobSpec
from crowdtrain.core.storage import Storage
from crowdtrain.core.tensors import (
    Params,
    decode_shard,
    encode,
    encode_shard,
    manifest_of,
    sha256,
)
from crowdtrain.core.updates import upload_of
from crowdtrain.core.zoo_keras import build_model as build_keras_model
from crowdtrain.server.ledger import experts as mixtures
from crowdtrain.server.ledger import jobs, snapshot_list
from crowdtrain.server.ledger.models import Job, Shard
from crowdtrain.server.paramstore import store
from crowdtrain.workgen.datasets import deal_shards
from crowdtrain.workgen.image_decoding import DEFAULT_IMAGE_BOUNDS, ImageBounds
from crowdtrain.workgen.staging import StagedDataset, stage_dataset

log = logging.getLogger(__name__)

# The PyTorch zoo builds W_s version 0 of every zoo model. It imports torch, so it is imported by name
# when a job is first submitted: a scheduler worker that only hands out work never loads torch.
TORCH_ZOO = "crowdtrain.core.zoo"


@dataclass(frozen=True)
class PreparedJob:
    job_id: int
    shards: int
    parameters: int
    recipe: str  # what the operator's project key signs (crowdtrain.core.signing.recipe_document)


def submit_job(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    spec: JobSpec,
    upload_max_bytes: int,
    scratch: Path | None = None,
    dataset_max_bytes: int = 4 * 1024**3,
    hold_for_signature: bool = False,
    image_bounds: ImageBounds = DEFAULT_IMAGE_BOUNDS,
) -> PreparedJob:
    """Create a job and its first epoch; with `hold_for_signature` (the scheduler has a project key),
    the job stays pending until the operator signs its recipe (crowdtrain.server.ledger.jobs.sign_job).

    A spec that could only give a stuck or silently wrong job (a bad dataset, a model that cannot
    take its examples or whose parameters exceed `upload_max_bytes`, the largest upload the
    scheduler accepts) raises ValueError naming the field and the problem, before anything is stored.
    The dataset is dealt in a temporary folder under `scratch` (default: the system's), removed after;
    `dataset_max_bytes` bounds an uploaded folder once unpacked, `image_bounds` what decoding an image
    folder may cost (its pixels in all, and the time and memory of the child process that decodes it).
    """
    if hold_for_signature and spec.dataset.reshuffle_each_epoch:
        # The recipe names every shard a client may be sent; a re-dealt epoch's are made after it is signed.
        raise ValueError(
            "dataset.reshuffle_each_epoch: a signed job's shards are fixed when it is submitted, so its "
            "epochs cannot deal them anew; this scheduler signs its work, so turn reshuffling off"
        )
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dataset-", dir=scratch) as folder:
        staged = stage_dataset(spec.dataset, spec.seed, storage, Path(folder), dataset_max_bytes, image_bounds)
        return _create_job(db, storage, r, spec, staged, upload_max_bytes, hold_for_signature)


def _create_job(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    spec: JobSpec,
    data: StagedDataset,
    upload_max_bytes: int,
    hold_for_signature: bool,
) -> PreparedJob:
    """submit_job once the dataset is checked and dealt: the model checked, then everything stored."""
    model_config = spec.configure_model(data.input_shape, data.num_classes)
    model = initial_parameters(model_config, spec.seed, upload_max_bytes)
    params, n_parameters = model.params, model.parameters
    initial = encode(params)
    if len(initial) > upload_max_bytes:
        raise ValueError(
            f"model: its parameters take {len(initial):,} bytes, more than the scheduler accepts in "
            f"one upload ({upload_max_bytes:,} bytes, upload_max_bytes)"
        )
    recorded = spec.model_dump(mode="json")
    if spec.experts is not None:  # mode moe: the experts its trainers call, leased to expert hosts from now on
        model_config["mixture"] = mixtures.create_mixture(db, spec.name, spec.experts)
    if data.label_names is not None:  # the order string labels were numbered in (DatasetSpec.label_names)
        recorded["dataset"]["label_names"] = data.label_names
    job_id = jobs.create_job(
        db, spec.name, spec.mode, recorded, model_config, manifest_of(params), len(initial), model.training_flops
    )
    try:
        shard_rows = []
        for index in range(len(data.shard_sizes)):
            blob = encode_shard(*data.shard(index))
            key = keys.shard_key(job_id, 0, index)
            storage.put(key, blob)
            shard_rows.append(
                Shard(
                    job_id=job_id,
                    epoch=0,
                    index=index,
                    key=key,
                    sha256=sha256(blob),
                    size=len(blob),
                    examples=data.shard_sizes[index],
                )
            )
        storage.put(keys.validation_key(job_id), encode_shard(*data.validation))
        storage.put(keys.snapshot_key(job_id, 0), initial)
        store.initialise(r, job_id, params)
        snapshot_list.note_snapshot(r, job_id, 0, keep=1_000_000)
    except Exception as exc:
        jobs.fail_preparation(db, job_id, f"preparing the job failed: {exc}")
        raise
    recipe = signing.canonical_json(
        signing.recipe_document(
            job_id,
            spec.name,
            model_config,
            signing.recipe_training(recorded),
            upload_of(recorded.get("assimilation", {})).model_dump(mode="json"),
            spec.seed,
            [row.sha256 for row in shard_rows if row.sha256 is not None],
            sha256(initial),
            spec.mode,
        )
    )
    jobs.start_job(db, job_id, shard_rows, sha256(initial), recipe, hold_for_signature)
    log.info(
        "job %s (%s, %s): %d shards, %d parameters%s; %s",
        job_id,
        spec.name,
        spec.mode,
        len(shard_rows),
        n_parameters,
        f", merge rule {effective_rule(spec.assimilation)}" if spec.mode in WORKUNIT_MODES else "",
        "waiting for the operator's signature" if hold_for_signature else "running",
    )
    return PreparedJob(job_id, len(shard_rows), n_parameters, recipe)


@dataclass(frozen=True)
class InitialModel:
    params: Params  # W_s version 0 in the canonical layout
    parameters: int  # trainable parameters
    training_flops: int  # to train on one example (the unit of a host's credit)


def initial_parameters(model_config: dict, seed: int, max_bytes: int) -> InitialModel:
    """W_s version 0 in the canonical layout, its number of trainable parameters and the FLOPs of
    training on one example.

    Zoo models start from the PyTorch zoo whatever the job's framework (its layout is canonical),
    once `check_model` has seen, without allocating them, that they take the dataset's examples
    and fit in `max_bytes`. A Keras JSON model is built in safe mode, which refuses Lambda layers
    and other code, and checked for its input and output shapes; its training FLOPs are estimated as
    6 per trainable parameter (2 forward, 4 backward: exact for dense layers, low for convolutions).
    """
    if model_config["name"] != KERAS_MODEL:
        zoo = importlib.import_module(TORCH_ZOO)
        zoo.check_model(
            model_config["name"],
            model_config["input_shape"],
            model_config["num_classes"],
            model_config["options"],
            max_bytes,
        )
        model = zoo.build_model(
            model_config["name"],
            model_config["input_shape"],
            model_config["num_classes"],
            seed=seed,
            **model_config["options"],
        )
        flops = zoo.training_flops_per_example(model, model_config["input_shape"])
        return InitialModel(zoo.state_to_numpy(model), zoo.count_parameters(model), flops)
    try:
        keras_model = build_keras_model(model_config, seed=seed)
    except ImportError:
        raise ValueError("this server cannot load Keras JSON models: install crowdtrain[tensorflow]") from None
    trainable = sum(int(np.prod(v.shape)) for v in keras_model.model.trainable_weights)
    return InitialModel(keras_model.get_params(), trainable, 6 * trainable)


def write_epoch_shards(s: Session, storage: Storage, job: Job, epoch: int) -> int:
    """Write the re-dealt shards of `epoch` to storage and record their hashes; 0 if already written.

    The examples are those of the job's epoch-0 shards, dealt anew with the job's
    `dataset.shuffle` and the seed (job seed, epoch). Call it in the transaction that hands one of
    them out: the shard rows are locked and checked again first, so concurrent dispatchers write
    them once (a rolled-back writer leaves only bytes that the next one overwrites). Returns the
    number of shards written.
    """
    # populate_existing: rows this session loaded before the lock may have been written since.
    rows = s.scalars(
        select(Shard)
        .where(Shard.job_id == job.id, Shard.epoch == epoch)
        .order_by(Shard.index)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).all()
    if not rows or all(sh.sha256 is not None for sh in rows):
        return 0
    shared = s.scalars(select(Shard).where(Shard.job_id == job.id, Shard.epoch == 0).order_by(Shard.index)).all()
    parts = [decode_shard(storage.get(sh.key)) for sh in shared]
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    dataset = job.spec["dataset"]
    # A job submitted before dataset.shuffle existed has no such field: it gets the default.
    for sh, picked in zip(
        rows, deal_shards(y, len(rows), dataset.get("shuffle", "stratified"), job.spec["seed"], epoch), strict=True
    ):
        blob = encode_shard(x[picked], y[picked])
        storage.put(sh.key, blob)
        sh.sha256, sh.size, sh.examples = sha256(blob), len(blob), len(picked)
    s.flush()
    log.info("job %s: epoch %d's %d shards dealt anew and written", job.id, epoch, len(rows))
    return len(rows)
