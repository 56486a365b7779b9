"""Operator-facing job services: status with per-epoch figures, cancellation."""

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta

import redis
from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.jobspec import DEDLOC
from crowdtrain.core.refusals import NotFound
from crowdtrain.core.schemas_jobs import (
    EpochFigures,
    InFlightFigures,
    JobStatusOut,
    JobSummary,
    MetricPoint,
    best_closed_epoch,
)
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger import exports
from crowdtrain.server.ledger import jobs as ledger_jobs
from crowdtrain.server.ledger.models import Assignment, Job, Metric, Workunit, utcnow
from crowdtrain.server.services.backpressure import UNMERGED, BudgetTerms, in_flight_budget

ACTIVE_HOST_WINDOW = timedelta(seconds=60)


class JobNotFound(NotFound):
    pass


def job_status(db: sessionmaker[Session], job_id: int, with_metrics: bool = False) -> JobStatusOut:
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"job {job_id} does not exist")
        metric_rows = (
            s.execute(
                select(Metric.epoch, Metric.param_version, Metric.val_accuracy, Metric.val_loss, Metric.created_at)
                .where(Metric.job_id == job_id)
                .order_by(Metric.param_version)
            ).all()
            if with_metrics
            else []
        )
        a_counts: dict[str, int] = {
            status: count
            for status, count in s.execute(
                select(Assignment.status, func.count()).where(Assignment.job_id == job_id).group_by(Assignment.status)
            )
        }
        active = s.scalar(
            select(func.count(func.distinct(Assignment.host_id))).where(
                Assignment.job_id == job_id, Assignment.sent_at > utcnow() - ACTIVE_HOST_WINDOW
            )
        )
        figures = epoch_figures(s, job_id)
        best = best_closed_epoch(figures)
        start = job.started_at or job.created_at
        end = job.finished_at or utcnow()
        return JobStatusOut(
            job_id=job.id,
            name=job.name,
            status=JobStatus(job.status),
            status_message=job.status_message,
            current_epoch=job.current_epoch,
            param_version=job.param_version,
            snapshot_version=job.snapshot_version,
            target_accuracy=job.spec["stop"]["target_accuracy"],
            max_epochs=job.spec["stop"]["max_epochs"],
            best_epoch_accuracy=None if best is None else best.mean_accuracy,
            final_accuracy=job.final_accuracy,
            merges=a_counts.get(AssignmentStatus.merged.value, 0),
            active_hosts=active or 0,
            assignments={AssignmentStatus(k): n for k, n in a_counts.items()},
            epochs=figures,
            metrics=_metric_points(s, job, metric_rows, start) if with_metrics else [],
            elapsed_seconds=(end - start).total_seconds(),
            in_flight=None if job.mode == DEDLOC else in_flight_figures(s, job, a_counts),
            mixture_id=job.model_config_.get("mixture"),
        )


def epoch_figures(s: Session, job_id: int) -> list[EpochFigures]:
    """Each epoch of the job (a DeDLOC job's: each step evaluated), oldest first: its workunits by
    outcome and its merges' validation accuracy (mean: the epoch's figure)."""
    epochs: dict[int, dict] = defaultdict(
        lambda: {"workunits": 0, "done": 0, "failed": 0, "accs": (0, None, None, None)}
    )
    for epoch, status, n in s.execute(
        select(Workunit.epoch, Workunit.status, func.count())
        .where(Workunit.job_id == job_id)
        .group_by(Workunit.epoch, Workunit.status)
    ):
        e = epochs[epoch]
        e["workunits"] += n
        if status == WorkunitStatus.done.value:
            e["done"] += n
        elif status == WorkunitStatus.failed.value:
            e["failed"] += n
    for epoch, *accs in s.execute(
        select(
            Metric.epoch,
            func.count(),
            func.avg(Metric.val_accuracy),
            func.min(Metric.val_accuracy),
            func.max(Metric.val_accuracy),
        )
        .where(Metric.job_id == job_id)
        .group_by(Metric.epoch)
    ):
        epochs[epoch]["accs"] = tuple(accs)
    return [
        EpochFigures(
            epoch=k,
            workunits=v["workunits"],
            done=v["done"],
            failed=v["failed"],
            merges=v["accs"][0],
            mean_accuracy=v["accs"][1],
            min_accuracy=v["accs"][2],
            max_accuracy=v["accs"][3],
        )
        for k, v in sorted(epochs.items())
    ]


def in_flight_figures(s: Session, job: Job, a_counts: dict[str, int]) -> InFlightFigures:
    """The job's unmerged assignments against its budget, as dispatch judges it (services.backpressure)."""
    count = sum(a_counts.get(status, 0) for status in UNMERGED)
    hosts = (
        s.scalar(
            select(func.count(func.distinct(Assignment.host_id))).where(
                Assignment.job_id == job.id, Assignment.status.in_(UNMERGED)
            )
        )
        if count
        else 0
    )
    terms = BudgetTerms.of(job.spec)
    budget = in_flight_budget(terms, job.merge_rate, job.turnaround_seconds, hosts or 0, job.param_version or 0)
    return InFlightFigures(
        count=count,
        budget=budget,
        derived=terms.max_in_flight is None and terms.round_size is None,
        held_back=job.status == JobStatus.running.value and budget is not None and count >= budget,
        merge_rate=job.merge_rate,
        turnaround_seconds=job.turnaround_seconds,
    )


def _metric_points(s: Session, job: Job, metric_rows: Sequence[Row], start: datetime) -> list[MetricPoint]:
    """Every validation point, with the examples merged into W_s up to its version (None in dedloc mode,
    whose steps are not assignments)."""
    merged: list[tuple[int, int]] = []
    if job.mode != DEDLOC:
        rows = s.execute(
            select(Assignment.merged_version, func.coalesce(Assignment.examples, 0)).where(
                Assignment.job_id == job.id,
                Assignment.status == AssignmentStatus.merged.value,
                Assignment.merged_version.is_not(None),
            )
        ).all()
        merged = sorted((version, n) for version, n in rows if version is not None)
    points: list[MetricPoint] = []
    seen = examples = 0
    for m in metric_rows:
        while seen < len(merged) and merged[seen][0] <= m.param_version:
            examples += merged[seen][1]
            seen += 1
        points.append(
            MetricPoint(
                epoch=m.epoch,
                param_version=m.param_version,
                val_accuracy=m.val_accuracy,
                val_loss=m.val_loss,
                t=(m.created_at - start).total_seconds(),
                examples=None if job.mode == DEDLOC else examples,
            )
        )
    return points


def list_jobs(db: sessionmaker[Session]) -> list[JobSummary]:
    """Every job, oldest first, with the accuracy the operator would quote: the exported model's once the
    job has ended, else the latest validation's."""
    with db.begin() as s:
        latest = select(Metric.job_id, func.max(Metric.id).label("metric_id")).group_by(Metric.job_id).subquery()
        rows = s.execute(select(Metric.job_id, Metric.val_accuracy).join(latest, Metric.id == latest.c.metric_id))
        accuracy = {job_id: value for job_id, value in rows}
        return [
            JobSummary(
                job_id=j.id,
                name=j.name,
                status=JobStatus(j.status),
                current_epoch=j.current_epoch,
                mode=j.mode,
                max_epochs=j.spec["stop"].get("max_epochs"),
                accuracy=j.final_accuracy if j.final_accuracy is not None else accuracy.get(j.id),
                created_at=j.created_at,
            )
            for j in s.scalars(select(Job).order_by(Job.id)).all()
        ]


def cancel_job(db: sessionmaker[Session], r: redis.Redis, job_id: int) -> JobStatus:
    """Cancel a pending or running job (crowdtrain.server.ledger.jobs.cancel_job); JobNotFound if
    there is no such job. Returns its new status."""
    status = ledger_jobs.cancel_job(db, r, job_id)
    if status is None:
        raise JobNotFound(f"job {job_id} does not exist")
    return JobStatus(status)


def final_model_key(db: sessionmaker[Session], storage: Storage, r: redis.Redis, job_id: int) -> str | None:
    """Where the job's final model is; None while it has none. A job whose end is recorded but whose
    export has not been written yet (crowdtrain.server.ledger.exports.export_final_model) is exported now."""
    return exports.export_final_model(db, storage, r, job_id)  # NotFound for no such job
