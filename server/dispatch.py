"""Handing workunits to hosts: atomic claims, locality, reliability, early epoch release, and the
share of the local epochs each host trains (dynamic local work, server.local_work)."""

import logging
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain import frameworks
from crowdtrain.jobspec import VC_ASGD
from crowdtrain.logs import ids
from crowdtrain.schemas import AssignmentOut, FileRef, Recipe, Resources
from crowdtrain.storage import Storage
from crowdtrain.updates import upload_of
from server import local_work, states
from server.models import Assignment, Host, Job, Shard, Workunit, utcnow
from server.states import AssignmentStatus, JobStatus, WorkunitStatus
from workgen.generator import next_epoch_releasable, release_epoch, write_epoch_shards

log = logging.getLogger(__name__)

RELIABLE_AFTER = 3  # consecutive valid results before a host gets retried workunits first
LAST_SEEN_RESOLUTION = timedelta(seconds=15)


def _claim_ready(s: Session, job: Job, host: Host, limit: int, cached: list[str]) -> list[tuple[Workunit, Shard]]:
    """Lock up to `limit` ready workunits of `job`; concurrent claimers skip each other's rows.

    Preferences are tried as separate queries, each an index range scan on (job, status, epoch, id):
    first workunits whose shard the host has cached, then retried workunits if the host is
    reliable (fresh ones if it is not), then any. One query ordering by all the preferences at
    once would sort every ready workunit of the job on each request.
    """
    reliable = host.consecutive_valid >= RELIABLE_AFTER
    filters = []
    if cached:
        filters.append(Workunit.shard_id.in_(select(Shard.id).where(Shard.job_id == job.id,
                                                                    Shard.sha256.in_(cached))))
    filters += [Workunit.error_count > 0 if reliable else Workunit.error_count == 0, None]
    claimed: list[Workunit] = []
    for extra in filters:
        if len(claimed) >= limit:
            break
        query = (select(Workunit).where(Workunit.job_id == job.id, Workunit.status == WorkunitStatus.ready.value)
                 .order_by(Workunit.epoch, Workunit.id).limit(limit - len(claimed))
                 .with_for_update(skip_locked=True))
        if extra is not None:
            query = query.where(extra)
        if claimed:
            query = query.where(Workunit.id.not_in([wu.id for wu in claimed]))
        claimed += s.scalars(query).all()
    shards = {sh.id: sh for sh in s.scalars(select(Shard).where(Shard.id.in_({wu.shard_id for wu in claimed})))}
    return [(wu, shards[wu.shard_id]) for wu in claimed]


def _assignment_out(a: Assignment, wu: Workunit, shard: Shard, job: Job, storage: Storage,
                    presign_seconds: int) -> AssignmentOut:
    # Object storage that can presign serves the bytes itself; otherwise the scheduler does.
    shard_url = storage.presigned_url(shard.key, presign_seconds) or f"/v1/shards/{shard.id}"
    snapshot_url = (storage.presigned_url(job.snapshot_key, presign_seconds)
                    or f"/v1/jobs/{job.id}/snapshots/{job.snapshot_version}")
    return AssignmentOut(
        assignment_id=a.id, job_id=job.id, workunit_id=wu.id, epoch=wu.epoch, shard_index=shard.index,
        base_version=a.base_version, deadline=a.deadline, local_fraction=a.local_fraction,
        recipe=Recipe(model=job.model_config_, training=job.spec["training"], seed=job.spec["seed"] + a.id,
                      upload=upload_of(job.spec.get("assimilation", {}))),
        shard=FileRef(url=shard_url, sha256=shard.sha256, size=shard.size),
        snapshot=FileRef(url=snapshot_url, sha256=job.snapshot_sha256, size=job.param_bytes))


def request_work(db: sessionmaker[Session], storage: Storage, host_id: int, free_slots: int, cached: list[str],
                 resources: Resources | None, presign_seconds: int = 900) -> list[AssignmentOut]:
    """Give the host up to `free_slots` assignments; no workunit is ever held by two hosts at once."""
    with db.begin() as s:
        host = s.get_one(Host, host_id)
        now = utcnow()
        if now - host.last_seen > LAST_SEEN_RESOLUTION:  # spare a row write on most polls
            host.last_seen = now
        if resources is not None:
            host.cpus, host.ram_bytes, host.gpu, host.device = (resources.cpus, resources.ram_bytes,
                                                                resources.gpu, resources.device)
            if host.frameworks != (declared := ",".join(resources.frameworks)):
                host.frameworks = declared
        if free_slots == 0:
            return []
        # Only VC-ASGD jobs have workunits; DeDLOC peers join their job through server.dedloc.
        jobs = [job for job in s.scalars(select(Job).where(Job.status == JobStatus.running.value,
                                                           Job.mode == VC_ASGD).order_by(Job.id))
                if host_can_run(host, job)]
        out: list[AssignmentOut] = []
        for job in jobs:
            claimed = _take(s, _claim_ready(s, job, host, free_slots - len(out), cached))
            if len(claimed) < free_slots - len(out) and _release_next_epoch(s, job):
                claimed += _take(s, _claim_ready(s, job, host, free_slots - len(out) - len(claimed), cached))
            if not claimed:
                continue
            _write_unwritten_shards(s, storage, job, [shard for _, shard in claimed])
            fraction = local_work.fraction_for(s, job, host.id)
            now = utcnow()
            deadline = now + timedelta(seconds=job.spec["scheduling"]["deadline_seconds"])
            for wu, shard in claimed:
                a = Assignment(workunit_id=wu.id, job_id=job.id, host_id=host.id, base_version=job.snapshot_version,
                               local_fraction=fraction, status=AssignmentStatus.in_progress.value, sent_at=now,
                               deadline=deadline)
                s.add(a)
                s.flush()
                out.append(_assignment_out(a, wu, shard, job, storage, presign_seconds))
                log.info("assignment %s: job %s epoch %d shard %d -> host %s (base v%d, local fraction %.2f, "
                         "deadline %s)", a.id, job.id, wu.epoch, shard.index, host.id, a.base_version,
                         a.local_fraction, deadline.isoformat(timespec="seconds"),
                         extra=ids(job_id=job.id, epoch=wu.epoch, workunit_id=wu.id, assignment_id=a.id,
                                   host_id=host.id))
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


def _take(s: Session, claimed: list[tuple[Workunit, Shard]]) -> list[tuple[Workunit, Shard]]:
    """Mark claimed workunits in progress at once: SKIP LOCKED does not skip rows this same
    transaction already holds, so a second claim must not see them ready."""
    for wu, _ in claimed:
        states.move(wu, WorkunitStatus.in_progress)
    s.flush()
    return claimed


def _release_next_epoch(s: Session, job: Job) -> bool:
    """Release the next epoch if the current one has nothing left to dispatch.

    True when a newer epoch is now available to claim from, whoever released it.
    """
    seen_epoch = job.current_epoch
    # A cheap look first: idle hosts asking for work must not all queue on the job row's lock.
    if not next_epoch_releasable(s, job, ignore_ready=True):
        s.refresh(job)
        return job.current_epoch > seen_epoch
    # Serialise on the job row so that two schedulers cannot both release the same epoch.
    s.execute(select(Job.id).where(Job.id == job.id).with_for_update())
    s.refresh(job)
    if job.current_epoch > seen_epoch:
        return True
    # Ready rows locked by other claims in flight are as good as taken; an unlocked one is claimable.
    unlocked_ready = s.scalar(select(Workunit.id).where(
        Workunit.job_id == job.id, Workunit.epoch == job.current_epoch,
        Workunit.status == WorkunitStatus.ready.value).limit(1).with_for_update(skip_locked=True))
    if unlocked_ready is not None:
        return True
    if not next_epoch_releasable(s, job, ignore_ready=True):
        return False
    release_epoch(s, job, job.current_epoch + 1)
    s.flush()
    return True
