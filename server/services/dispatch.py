"""Handing workunits to hosts: atomic claims, fair share between jobs, locality, reliability, early
epoch release, straggler duplicates at an epoch's tail, and the share of the local epochs each host
trains (dynamic local work, crowdtrain.server.services.local_work)."""

import logging
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import frameworks
from crowdtrain.core.jobspec import VC_ASGD, scheduling_of, validation_of
from crowdtrain.core.logs import ids
from crowdtrain.core.schemas import AssignmentOut, FileRef, Recipe, Resources, SignedRecipe
from crowdtrain.core.states import JobStatus
from crowdtrain.core.storage import Storage
from crowdtrain.core.updates import upload_of
from crowdtrain.server.ledger import replicas, reputation
from crowdtrain.server.ledger.assignments import claim_workunits, open_assignment
from crowdtrain.server.ledger.duplicates import claim_straggler_duplicates
from crowdtrain.server.ledger.epochs import release_next_epoch_early
from crowdtrain.server.ledger.models import (
    Assignment,
    Host,
    Job,
    Shard,
    Workunit,
    utcnow,
)
from crowdtrain.server.services import fair_share, local_work
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
        signed=_signed_recipe(job),
    )


def _signed_recipe(job: Job) -> SignedRecipe | None:
    if job.recipe is None or job.recipe_public_key is None or job.recipe_signature is None:
        return None
    return SignedRecipe(recipe=job.recipe, public_key=job.recipe_public_key, signature=job.recipe_signature)


def request_work(
    db: sessionmaker[Session],
    storage: Storage,
    host_id: int,
    free_slots: int,
    cached: list[str],
    resources: Resources | None,
    presign_seconds: int = 900,
    refused_jobs: frozenset[int] = frozenset(),
) -> list[AssignmentOut]:
    """Give the host up to `free_slots` assignments: ready workunits of the jobs it can run and has not
    refused (their recipe unsigned or signed by a key the host does not trust), split by
    fair share (crowdtrain.server.services.fair_share); then, for slots no job can fill, duplicates of
    stragglers (crowdtrain.server.ledger.duplicates). Replicas that jobs validating their results want
    come first (crowdtrain.server.ledger.replicas). No workunit is ever held by two hosts at once,
    except a straggler's and its one duplicate, and a replicated workunit's replicas. A quarantined
    host gets nothing."""
    with db.begin() as s:
        host = s.get_one(Host, host_id)
        _note_host(host, resources)
        if free_slots == 0 or reputation.is_quarantined(host):
            return []
        # Only VC-ASGD jobs have workunits; DeDLOC peers join their job through crowdtrain.server.services.dedloc.
        jobs = {
            job.id: job
            for job in s.scalars(
                select(Job).where(Job.status == JobStatus.running.value, Job.mode == VC_ASGD).order_by(Job.id)
            )
            if job.id not in refused_jobs and host_can_run(host, job)
        }
        scheduling = {job_id: scheduling_of(job.spec) for job_id, job in jobs.items()}
        weights = {job_id: sched.weight for job_id, sched in scheduling.items()}
        validation = {job_id: validation_of(job.spec) for job_id, job in jobs.items()}
        running = fair_share.running_assignments(s, list(jobs))
        out: list[AssignmentOut] = []
        for job_id, job in jobs.items():
            if validation[job_id].enabled and len(out) < free_slots:
                wanted = replicas.claim_replicas(s, job, host, free_slots - len(out))
                out += _open_assignments(s, storage, job, host, wanted, presign_seconds, "replica, ")
        for job, claimed in _claim_fair_share(s, jobs, host, free_slots - len(out), cached, running, weights):
            for wu, _ in claimed:
                wu.quorum = replicas.quorum_for(host, validation[job.id])
            out += _open_assignments(s, storage, job, host, claimed, presign_seconds)
        # Slots left over: no job has anything ready, even in an early-released epoch. A host whose
        # work the job replicates gets no duplicate (its result would be merged unchecked).
        for job_id in fair_share.by_share(running, weights):
            after = scheduling[job_id].duplicate_after_seconds
            if len(out) >= free_slots or after is None or replicas.replicated_host(host, validation[job_id]):
                continue
            duplicates = claim_straggler_duplicates(s, jobs[job_id], host, free_slots - len(out), after)
            out += _open_assignments(
                s, storage, jobs[job_id], host, duplicates, presign_seconds, "duplicate of a straggler, "
            )
        return out


def _note_host(host: Host, resources: Resources | None) -> None:
    """Record that the host asked (at most every LAST_SEEN_RESOLUTION) and what it declared."""
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


def _claim_fair_share(
    s: Session,
    jobs: dict[int, Job],
    host: Host,
    slots: int,
    cached: list[str],
    running: dict[int, int],
    weights: dict[int, float],
) -> list[tuple[Job, list[tuple[Workunit, Shard]]]]:
    """Claim up to `slots` ready workunits among `jobs`, split by fair share; a job that gives fewer
    than its part has nothing more, and the rest is split again among the others. `running` is
    updated with what was claimed."""
    given: list[tuple[Job, list[tuple[Workunit, Shard]]]] = []
    open_jobs = dict(weights)
    while slots > 0 and open_jobs:
        plan = fair_share.split_slots(slots, running, open_jobs)
        for job_id, n in plan.items():
            if n == 0:
                continue
            claimed = _claim_ready(s, jobs[job_id], host, n, cached)
            if claimed:
                given.append((jobs[job_id], claimed))
                running[job_id] = running.get(job_id, 0) + len(claimed)
                slots -= len(claimed)
            if len(claimed) < n:
                del open_jobs[job_id]
    return given


def _claim_ready(s: Session, job: Job, host: Host, n: int, cached: list[str]) -> list[tuple[Workunit, Shard]]:
    """Up to `n` ready workunits of `job`, releasing its next epoch early when the current one runs out."""
    claimed = claim_workunits(s, job, host, n, cached)
    if len(claimed) < n and release_next_epoch_early(s, job):
        claimed += claim_workunits(s, job, host, n - len(claimed), cached)
    return claimed


def _open_assignments(
    s: Session,
    storage: Storage,
    job: Job,
    host: Host,
    claimed: list[tuple[Workunit, Shard]],
    presign_seconds: int,
    kind: str = "",
) -> list[AssignmentOut]:
    """Open the assignments of the claimed workunits (or straggler duplicates, or replicas: `kind` says
    which in the log) and describe them."""
    if not claimed:
        return []
    _write_unwritten_shards(s, storage, job, [shard for _, shard in claimed])
    fraction = local_work.fraction_for(s, job, host.id)
    now = utcnow()
    deadline = now + timedelta(seconds=job.spec["scheduling"]["deadline_seconds"])
    out = []
    for wu, shard in claimed:
        a = open_assignment(s, wu, job, host, fraction, now, deadline)
        out.append(_assignment_out(a, wu, shard, job, storage, presign_seconds))
        log.info(
            "assignment %s: job %s epoch %d shard %d -> host %s (%sbase v%d, local fraction %.2f, deadline %s)",
            a.id,
            job.id,
            wu.epoch,
            shard.index,
            host.id,
            kind,
            a.base_version,
            a.local_fraction,
            deadline.isoformat(timespec="seconds"),
            extra=ids(job_id=job.id, epoch=wu.epoch, workunit_id=wu.id, assignment_id=a.id, host_id=host.id),
        )
    return out


def _write_unwritten_shards(s: Session, storage: Storage, job: Job, shards: list[Shard]) -> None:
    """Write the re-dealt shards of an epoch (dataset.reshuffle_each_epoch) before handing one out."""
    for epoch in sorted({sh.epoch for sh in shards if sh.sha256 is None}):
        write_epoch_shards(s, storage, job, epoch)


def host_can_run(host: Host, job: Job) -> bool:
    """Whether one of the host's frameworks trains the job's model (a Keras JSON model needs
    TensorFlow; a zoo model, any framework with a port of it)."""
    return frameworks.pick(job.model_config_, host.frameworks.split(",")) is not None
