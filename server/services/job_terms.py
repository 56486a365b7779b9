"""What a work request knows of the running jobs: their live columns, read with the host's row in
each request (`LiveJob`), and what never changes in a job after its submission, read once per
process (`JobTerms`, kept by `TermsCache`)."""

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, bindparam, select

from crowdtrain.core import frameworks
from crowdtrain.core.jobspec import SchedulingSpec, scheduling_of
from crowdtrain.core.schemas import Recipe
from crowdtrain.core.updates import upload_of
from crowdtrain.core.validationspec import ValidationSpec, validation_of
from crowdtrain.server.ledger.models import Job
from crowdtrain.server.services.backpressure import BudgetTerms

# The columns of `LiveJob`, in its fields' order.
LIVE_JOB_COLUMNS = (
    Job.id,
    Job.created_at,
    Job.current_epoch,
    Job.snapshot_version,
    Job.snapshot_key,
    Job.snapshot_sha256,
    Job.param_bytes,
    Job.recipe_public_key,
    Job.recipe_signature,
    Job.merge_rate,
    Job.turnaround_seconds,
    Job.param_version,
)


@dataclass(frozen=True, slots=True)
class LiveJob:
    """A running job's columns that change while it runs, as one request read them."""

    id: int
    created_at: datetime
    current_epoch: int
    snapshot_version: int
    snapshot_key: str | None
    snapshot_sha256: str | None
    param_bytes: int
    recipe_public_key: str | None
    recipe_signature: str | None
    merge_rate: float | None
    turnaround_seconds: float | None
    param_version: int  # the newest W_s version the ledger has recorded merged
    # How many of its assignments dispatched or uploaded but not merged the asking host holds, counted in
    # the same statement (crowdtrain.server.services.dispatch_host); all of them, and the hosts holding
    # them, as this process counts them (crowdtrain.server.services.in_flight_counts).
    held_by_host: int = 0
    in_flight: int = 0
    in_flight_hosts: int = 0


JobKey = tuple[str, int, datetime]


def job_key(c: Connection, job_id: int, created_at: datetime) -> JobKey:
    """How a process's caches know a running job: its database, id and creation time, so that a
    database made again under the same URL (tests do) cannot lend one job's entries to another."""
    return (str(c.engine.url), job_id, created_at)


_JOB_TERMS = select(Job.id, Job.spec, Job.model_config_.label("model_config_"), Job.recipe).where(
    Job.id.in_(bindparam("ids", expanding=True))
)


@dataclass
class JobTerms:
    """What a running job's dispatch needs that never changes after its submission: its spec parsed,
    the recipe every assignment carries (but for its seed), and which of the frameworks hosts
    declare can train its model."""

    job_id: int
    spec: dict[str, Any]
    model_config: dict[str, Any]
    recipe_text: str | None
    scheduling: SchedulingSpec
    validation: ValidationSpec
    recipe: Recipe
    budget: BudgetTerms  # what its in-flight budget depends on (crowdtrain.server.services.backpressure)
    runnable: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def read(cls, row: Row) -> "JobTerms":
        spec = row.spec
        return cls(
            job_id=row.id,
            spec=spec,
            model_config=row.model_config_,
            recipe_text=row.recipe,
            scheduling=scheduling_of(spec),
            validation=validation_of(spec),
            recipe=Recipe(
                model=row.model_config_,
                training=spec["training"],
                seed=spec["seed"],
                upload=upload_of(spec.get("assimilation", {})),
            ),
            budget=BudgetTerms.of(spec),
        )

    def runs_on(self, host_frameworks: str) -> bool:
        """Whether one of the frameworks a host declared (comma-separated) trains the job's model."""
        if host_frameworks not in self.runnable:
            self.runnable[host_frameworks] = frameworks.runs_on(self.model_config, host_frameworks)
        return self.runnable[host_frameworks]


class TermsCache:
    """JobTerms of the running jobs, each known by its `job_key`; jobs that no longer run are forgotten."""

    def __init__(self) -> None:
        self._terms: dict[JobKey, JobTerms] = {}
        self._lock = threading.Lock()

    def of(self, c: Connection, live: Mapping[int, LiveJob]) -> dict[int, JobTerms]:
        wanted = {job_id: job_key(c, job_id, job.created_at) for job_id, job in live.items()}
        with self._lock:
            missing = [job_id for job_id, key in wanted.items() if key not in self._terms]
        if missing:
            rows = c.execute(_JOB_TERMS, {"ids": missing}).all()
            with self._lock:
                self._terms.update({wanted[row.id]: JobTerms.read(row) for row in rows})
        with self._lock:
            if len(self._terms) > 4 * max(1, len(wanted)):
                keep = set(wanted.values())
                self._terms = {key: t for key, t in self._terms.items() if key in keep}
            return {job_id: self._terms[key] for job_id, key in wanted.items()}
