"""Handing workunits to hosts: atomic claims, locality, reliability, early epoch release, and the
share of the local epochs each host trains (dynamic local work, crowdtrain.server.services.local_work)."""

import logging
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import frameworks
from crowdtrain.core.jobspec import VC_ASGD
from crowdtrain.core.logs import ids
from crowdtrain.core.schemas import AssignmentOut, FileRef, Recipe, Resources
from crowdtrain.core.states import JobStatus
from crowdtrain.core.storage import Storage
from crowdtrain.core.updates import upload_of
from crowdtrain.server.ledger.assignments import claim_workunits, open_assignment
from crowdtrain.server.ledger.epochs import release_next_epoch_early
from crowdtrain.server.ledger.models import (
    Assignment,
    Host,
    Job,
    Shard,
    Workunit,
    utcnow,
)
from crowdtrain.server.services import local_work
from crowdtrain.workgen.generator import write_epoch_shards

log = logging.getLogger(__name__)

LAST_SEEN_RESOLUTION = timedelta(seconds=15)


def _assignment_out(
    a: Assignment, wu: Workunit, shard: Shard, job: Job, storage: Storage, presign_seconds: int
) -> AssignmentOut:
    # Written at submission, or (a re-dealt epoch's shard) before its first dispatch; v0 is published at submission.
    assert shard.sha256 is not None and job.snapshot_key is not None and job.snapshot_sha256 is not None
    # Object storage that can presign serves the bytes itself; otherwise the scheduler does.
    shard_url = storage.presigned_url(shard.key, presign_seconds) or f"/v1/shards/{shard.id}"
    snapshot_url = (
        storage.presigned_url(job.snapshot_key, presign_seconds)
        or f"/v1/jobs/{job.id}/snapshots/{job.snapshot_version}"
    )
    return AssignmentOut(
        assignment_id=a.id,
        job_id=job.id,
        workunit_id=wu.id,
        epoch=wu.epoch,
        shard_index=shard.index,
        base_version=a.base_version,
        deadline=a.deadline,
        local_fraction=a.local_fraction,
        recipe=Recipe(
            model=job.model_config_,
            training=job.spec["training"],
            seed=job.spec["seed"] + a.id,
            upload=upload_of(job.spec.get("assimilation", {})),
        ),
        shard=FileRef(url=shard_url, sha256=shard.sha256, size=shard.size),
        snapshot=FileRef(url=snapshot_url, sha256=job.snapshot_sha256, size=job.param_bytes),
    )


def request_work(
    db: sessionmaker[Session],
    storage: Storage,
    host_id: int,
    free_slots: int,
    cached: list[str],
    resources: Resources | None,
    presign_seconds: int = 900,
) -> list[AssignmentOut]:
    """Give the host up to `free_slots` assignments; no workunit is ever held by two hosts at once."""
    with db.begin() as s:
        host = s.get_one(Host, host_id)
        now = utcnow()
        if now - host.last_seen > LAST_SEEN_RESOLUTION:  # spare a row write on most polls
            host.last_seen = now
        if resources is not None:
            host.cpus, host.ram_bytes, host.gpu, host.device = (
                resources.cpus,
                resources.ram_bytes,
                resources.gpu,
                resources.device,
            )
            if host.frameworks != (declared := ",".join(resources.frameworks)):
                host.frameworks = declared
        if free_slots == 0:
            return []
        # Only VC-ASGD jobs have workunits; DeDLOC peers join their job through crowdtrain.server.services.dedloc.
        jobs = [
            job
            for job in s.scalars(
                select(Job).where(Job.status == JobStatus.running.value, Job.mode == VC_ASGD).order_by(Job.id)
            )
            if host_can_run(host, job)
        ]
        out: list[AssignmentOut] = []
        for job in jobs:
            claimed = claim_workunits(s, job, host, free_slots - len(out), cached)
            if len(claimed) < free_slots - len(out) and release_next_epoch_early(s, job):
                claimed += claim_workunits(s, job, host, free_slots - len(out) - len(claimed), cached)
            if not claimed:
                continue
            _write_unwritten_shards(s, storage, job, [shard for _, shard in claimed])
            fraction = local_work.fraction_for(s, job, host.id)
            now = utcnow()
            deadline = now + timedelta(seconds=job.spec["scheduling"]["deadline_seconds"])
            for wu, shard in claimed:
                a = open_assignment(s, wu, job, host, fraction, now, deadline)
                out.append(_assignment_out(a, wu, shard, job, storage, presign_seconds))
                log.info(
                    "assignment %s: job %s epoch %d shard %d -> host %s (base v%d, local fraction %.2f, deadline %s)",
                    a.id,
                    job.id,
                    wu.epoch,
                    shard.index,
                    host.id,
                    a.base_version,
                    a.local_fraction,
                    deadline.isoformat(timespec="seconds"),
                    extra=ids(job_id=job.id, epoch=wu.epoch, workunit_id=wu.id, assignment_id=a.id, host_id=host.id),
                )
            if len(out) >= free_slots:
                break
        return out


def _write_unwritten_shards(s: Session, storage: Storage, job: Job, shards: list[Shard]) -> None:
    """Write the re-dealt shards of an epoch (dataset.reshuffle_each_epoch) before handing one out."""
    for epoch in sorted({sh.epoch for sh in shards if sh.sha256 is None}):
        write_epoch_shards(s, storage, job, epoch)


def host_can_run(host: Host, job: Job) -> bool:
    """Whether one of the host's frameworks trains the job's model (a Keras JSON model needs
    TensorFlow; a zoo model, any framework with a port of it)."""
    return frameworks.pick(job.model_config_, host.frameworks.split(",")) is not None
