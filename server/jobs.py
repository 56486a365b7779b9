"""Operator-facing job services: status with per-epoch figures, cancellation."""

from datetime import datetime, timedelta

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from assimilator.epochs import cancel_open_workunits, close_merges
from crowdtrain.schemas import EpochFigures, JobStatusOut, MetricPoint
from server import states
from server.models import Assignment, Job, Metric, Workunit, utcnow
from server.results import end_assignment
from server.states import AssignmentStatus, JobStatus, WorkunitStatus

ACTIVE_HOST_WINDOW = timedelta(seconds=60)


class JobNotFound(LookupError):
    pass


def job_status(db: sessionmaker[Session], job_id: int, with_metrics: bool = False) -> JobStatusOut:
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"job {job_id} does not exist")
        wu_counts = s.execute(select(Workunit.epoch, Workunit.status, func.count())
                              .where(Workunit.job_id == job_id).group_by(Workunit.epoch, Workunit.status)).all()
        metric_rows = s.execute(select(Metric.epoch, Metric.param_version, Metric.val_accuracy, Metric.val_loss,
                                       Metric.created_at).where(Metric.job_id == job_id)
                                .order_by(Metric.param_version)).all()
        a_counts = dict(s.execute(select(Assignment.status, func.count()).where(Assignment.job_id == job_id)
                                  .group_by(Assignment.status)).tuples().all())
        active = s.scalar(select(func.count(func.distinct(Assignment.host_id))).where(
            Assignment.job_id == job_id, Assignment.sent_at > utcnow() - ACTIVE_HOST_WINDOW))
        epochs: dict[int, dict] = {}
        for epoch, status, n in wu_counts:
            e = epochs.setdefault(epoch, {"workunits": 0, "done": 0, "failed": 0, "accs": []})
            e["workunits"] += n
            if status == WorkunitStatus.done.value:
                e["done"] += n
            elif status == WorkunitStatus.failed.value:
                e["failed"] += n
        for m in metric_rows:
            epochs.setdefault(m.epoch, {"workunits": 0, "done": 0, "failed": 0, "accs": []})["accs"].append(
                m.val_accuracy)
        figures = [EpochFigures(epoch=k, workunits=v["workunits"], done=v["done"], failed=v["failed"],
                                merges=len(v["accs"]),
                                mean_accuracy=sum(v["accs"]) / len(v["accs"]) if v["accs"] else None,
                                min_accuracy=min(v["accs"], default=None), max_accuracy=max(v["accs"], default=None))
                   for k, v in sorted(epochs.items())]
        complete = [f.mean_accuracy for f in figures
                    if f.mean_accuracy is not None and f.done + f.failed == f.workunits]
        start = job.started_at or job.created_at
        end = job.finished_at or utcnow()
        return JobStatusOut(
            job_id=job.id, name=job.name, status=job.status, status_message=job.status_message,
            current_epoch=job.current_epoch, param_version=job.param_version, snapshot_version=job.snapshot_version,
            target_accuracy=job.spec["stop"]["target_accuracy"], max_epochs=job.spec["stop"]["max_epochs"],
            best_epoch_accuracy=max(complete, default=None), final_accuracy=job.final_accuracy,
            merges=a_counts.get(AssignmentStatus.merged.value, 0), active_hosts=active or 0,
            assignments=a_counts, epochs=figures,
            metrics=[MetricPoint(epoch=m.epoch, param_version=m.param_version, val_accuracy=m.val_accuracy,
                                 val_loss=m.val_loss, t=(m.created_at - start).total_seconds())
                     for m in metric_rows] if with_metrics else [],
            elapsed_seconds=(end - start).total_seconds())


def list_jobs(db: sessionmaker[Session]) -> list[dict]:
    with db.begin() as s:
        return [{"job_id": j.id, "name": j.name, "status": j.status, "current_epoch": j.current_epoch}
                for j in s.scalars(select(Job).order_by(Job.id)).all()]


def cancel_job(db: sessionmaker[Session], r: redis.Redis, job_id: int) -> str:
    """Cancel a pending or running job; its open workunits are cancelled, hosts are told at heartbeat,
    its merges are closed, and its uploaded results not in W_s are rejected (not charged) so that no
    merge of them is queued again. Those W_s already holds are recorded by their merge task."""
    with db.begin() as s:
        job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
        if job is None:
            raise JobNotFound(f"job {job_id} does not exist")
        states.move(job, JobStatus.cancelled)
        cancel_open_workunits(s, job_id)
        merged = close_merges(s, r, job_id)
        end_unmerged_uploads(s, job_id, "job cancelled by the operator before this result was merged", merged)
        job.status_message = "cancelled by the operator"
        job.finished_at = utcnow()
        return job.status


def end_unmerged_uploads(s: Session, job_id: int, message: str, merged: set[int],
                         uploaded_before: datetime | None = None) -> list[int]:
    """Reject, without charging anyone, the job's uploaded results (optionally only those uploaded
    before `uploaded_before`) that are not among `merged`, the final set of assignments W_s holds
    (the job's merges are closed). Returns the ids of the uploaded results W_s does hold: their
    merge is to be recorded, not refused."""
    query = select(Assignment).where(Assignment.job_id == job_id,
                                     Assignment.status == AssignmentStatus.uploaded.value).with_for_update()
    if uploaded_before is not None:
        query = query.where(Assignment.uploaded_at < uploaded_before)
    held = []
    for a in s.scalars(query.order_by(Assignment.id)).all():
        if a.id in merged:
            held.append(a.id)
        else:
            end_assignment(s, a, AssignmentStatus.rejected, message, charge=False)
    return held


def final_model_key(db: sessionmaker[Session], job_id: int) -> str | None:
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"job {job_id} does not exist")
        return job.final_key
