"""A job's life cycle outside its epochs: creation, start, failed preparation, cancellation, the end of
its unmerged uploads once it stops, and the steps of a DeDLOC job. Its epochs, and the stop rule that
ends a VC-ASGD job, are in crowdtrain.server.ledger.epochs."""

from datetime import datetime

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys, signing
from crowdtrain.core.jobspec import WORKUNIT_MODES
from crowdtrain.core.refusals import NotFound, Refusal, RefusalKind
from crowdtrain.core.states import AssignmentStatus, JobStatus
from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.assignments import end_assignment
from crowdtrain.server.ledger.epochs import release_epoch
from crowdtrain.server.ledger.job_end import cancel_open_workunits, close_merges, ending, lock_job
from crowdtrain.server.ledger.models import Assignment, Job, Metric, Shard, utcnow


def create_job(
    db: sessionmaker[Session],
    name: str,
    mode: str,
    spec: dict,
    model_config: dict,
    manifest: dict,
    param_bytes: int,
    training_flops: int = 0,
) -> int:
    """Record a new job, pending until `start_job` (or `fail_preparation`); returns its id. One transaction."""
    with db.begin() as s:
        job = Job(
            name=name,
            mode=mode,
            status=JobStatus.pending.value,
            spec=spec,
            model_config_=model_config,
            param_manifest=manifest,
            param_bytes=param_bytes,
            training_flops=training_flops,
        )
        s.add(job)
        s.flush()
        return job.id


def fail_preparation(db: sessionmaker[Session], job_id: int, message: str) -> None:
    """The pending job could not be prepared (its shards, validation split or W_s v0 not stored):
    it fails with `message`. One transaction."""
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        job.status_message = message
        states.move(job, JobStatus.failed)


AWAITING_SIGNATURE = "waiting for the operator's signature of its recipe (crowdtrain job sign)"


def start_job(
    db: sessionmaker[Session],
    job_id: int,
    shards: list[Shard],
    snapshot_sha256: str,
    recipe: str,
    hold_for_signature: bool = False,
) -> None:
    """The pending job's bytes are stored (its epoch-0 `shards`, its validation split, W_s v0 with
    `snapshot_sha256`): record them and its `recipe`, then set it running and, for VC-ASGD, release
    epoch 1; or, `hold_for_signature`, leave it pending until `sign_job`. One transaction."""
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        s.add_all(shards)
        job.validation_key = keys.validation_key(job_id)
        job.snapshot_version, job.snapshot_key, job.snapshot_sha256 = 0, keys.snapshot_key(job_id, 0), snapshot_sha256
        job.snapshot_at = utcnow()
        job.recipe = recipe
        if hold_for_signature:
            job.status_message = AWAITING_SIGNATURE
        else:
            _run(s, job)


def _run(s: Session, job: Job) -> None:
    job.started_at = utcnow()
    states.move(job, JobStatus.running)
    s.flush()
    if (
        job.mode in WORKUNIT_MODES
    ):  # DeDLOC peers need no workunits: crowdtrain.server.services.dedloc runs their rounds
        release_epoch(s, job, 1)


class SignatureRefused(Refusal):
    """A signature the job cannot take: the job has no recipe or has ended (conflict), or the
    signature does not verify with the project key (unacceptable)."""


def sign_job(db: sessionmaker[Session], job_id: int, public_key: str, signature: str) -> JobStatus:
    """Record `signature`, made by `public_key`, of the job's recipe. A job held for its signature
    starts running (epoch 1 released); a running job has its signature replaced (the project key
    was rotated). SignatureRefused, with nothing changed, if the signature does not verify or the job
    cannot take one; NotFound for no such job. Returns the job's status. One transaction."""
    with db.begin() as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        if job.recipe is None:
            raise SignatureRefused(f"job {job_id} has no recipe to sign (it was submitted before signed work)")
        if JobStatus(job.status).finished:
            raise SignatureRefused(f"job {job_id} is {job.status}: it takes no signature")
        if not signing.verify(public_key, job.recipe.encode(), signature):
            raise SignatureRefused(
                f"signature: it does not verify the recipe of job {job_id} with the project key "
                f"{signing.key_id(public_key)}",
                RefusalKind.unacceptable,
            )
        job.recipe_public_key, job.recipe_signature = public_key, signature
        if job.status == JobStatus.pending.value and job.snapshot_key is not None:
            job.status_message = ""
            _run(s, job)
        return JobStatus(job.status)


def cancel_job(db: sessionmaker[Session], r: redis.Redis, job_id: int) -> str | None:
    """Cancel a pending or running job (IllegalTransition otherwise); its open workunits are
    cancelled, hosts are told at heartbeat, its merges are closed, and its uploaded results not in
    W_s are rejected (not charged) so that no merge of them is queued again. Those W_s already holds
    are recorded by their merge task. Returns the new status, None if there is no such job. One transaction."""
    with ending(db, r) as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
        if job is None:
            return None
        states.move(job, JobStatus.cancelled)
        cancel_open_workunits(s, job_id)
        merged = close_merges(s, r, job_id)
        end_unmerged_uploads(s, job_id, "job cancelled by the operator before this result was merged", merged)
        job.status_message = "cancelled by the operator"
        job.finished_at = utcnow()
        return job.status


def end_unmerged_uploads(
    s: Session, job_id: int, message: str, merged: set[int], uploaded_before: datetime | None = None
) -> list[int]:
    """Reject in `s`, without charging anyone, the job's uploaded results (optionally only those
    uploaded before `uploaded_before`) that are not among `merged`, the final set of assignments W_s
    holds (the job's merges are closed). Returns the ids of the uploaded results W_s does hold: their
    merge is to be recorded, not refused."""
    query = (
        select(Assignment)
        .where(Assignment.job_id == job_id, Assignment.status == AssignmentStatus.uploaded.value)
        .with_for_update()
    )
    if uploaded_before is not None:
        query = query.where(Assignment.uploaded_at < uploaded_before)
    held = []
    for a in s.scalars(query.order_by(Assignment.id)).all():
        if a.id in merged:
            held.append(a.id)
        else:
            end_assignment(s, a, AssignmentStatus.rejected, message, charge=False)
    return held


def end_stalled_uploads(db: sessionmaker[Session], r: redis.Redis, uploaded_before: datetime) -> tuple[int, list[int]]:
    """End the results uploaded before `uploaded_before` and still unmerged while their job no longer
    runs (their merge task was lost). Each such job's merges are closed first, so the set W_s holds
    is final: a result in it is left for its merge to be recorded, any other is rejected, uncharged.
    Returns (how many were rejected, the ids of those W_s holds). One transaction."""
    ended, held = 0, []
    with ending(db, r) as s:
        jobs = s.scalars(
            select(Assignment.job_id)
            .distinct()
            .join(Job, Job.id == Assignment.job_id)
            .where(Job.status != JobStatus.running.value, Assignment.status == AssignmentStatus.uploaded.value)
        ).all()
        for job_id in jobs:
            stalled = s.scalar(
                select(func.count())
                .select_from(Assignment)
                .where(
                    Assignment.job_id == job_id,
                    Assignment.status == AssignmentStatus.uploaded.value,
                    Assignment.uploaded_at < uploaded_before,
                )
            )
            if not stalled:
                continue
            merged = close_merges(s, r, job_id)
            in_ws = end_unmerged_uploads(
                s, job_id, "the job ended before this result was merged", merged, uploaded_before=uploaded_before
            )
            held += in_ws
            ended += stalled - len(in_ws)
    return ended, held


def record_dedloc_state(
    db: sessionmaker[Session],
    job_id: int,
    step: int,
    loss: float,
    accuracy: float,
    state_sha256: str,
    outcome: tuple[JobStatus, str] | None,
) -> None:
    """Record a DeDLOC job's state at the start of `step` (stored under keys.dedloc_state_key): its
    validation figures as a Metric, and as the job's snapshot. With an `outcome` (status, message),
    a job still running ends so, its final model being that state (stored under keys.final_key).
    One transaction."""
    with db.begin() as s:
        job = lock_job(s, job_id)
        s.add(Metric(job_id=job_id, epoch=step, param_version=step, val_loss=loss, val_accuracy=accuracy))
        job.param_version = max(job.param_version, step)
        job.snapshot_version, job.snapshot_key = step, keys.dedloc_state_key(job_id, step)
        job.snapshot_sha256, job.snapshot_at = state_sha256, utcnow()
        if outcome is not None and job.status == JobStatus.running.value:
            states.move(job, outcome[0])
            job.status_message, job.final_key = outcome[1], keys.final_key(job_id)
            job.final_accuracy, job.finished_at = accuracy, utcnow()
            # A member uploads a state after the step that follows it committed: the job's version
            # is that of the state it ends at (its exported model), not the last commit's.
            job.param_version = step
