"""Wire schemas of the dashboard: the operator's job and hosts pages (`/dashboard/api`) and the public
project page (`/v1/project`), which shows progress and credit and no secrets."""

from pydantic import BaseModel, Field

from crowdtrain.core.schemas import HostPublic
from crowdtrain.core.schemas_jobs import JobProblems, JobStatusOut
from crowdtrain.core.states import JobStatus, WorkunitStatus


class HostCredit(BaseModel):
    """A host as the public sees it: no name, address or token."""

    host_id: int
    account: str
    credit: float
    results: int = Field(..., description="Results merged into a model")


class Staleness(BaseModel):
    """Staleness τ of merged results: W_s's version when the result was merged less the version it started from."""

    merges: int = Field(..., description="Merged results counted")
    mean: float | None
    max: int | None
    recent_mean: float | None = Field(..., description="Mean over the latest merges (up to 20)")


class JobDashboard(BaseModel):
    """Everything the operator's job page shows: the status with every validation point, merge rate,
    staleness, workunits by status and the job's problems."""

    job: JobStatusOut
    workunits: dict[WorkunitStatus, int] = Field(..., description="The job's workunits by status, every epoch")
    epoch_workunits: dict[WorkunitStatus, int] = Field(..., description="The current epoch's workunits by status")
    merges_per_second: float = Field(
        ..., description="Merges per second over the last minute (or the job's life, if shorter)"
    )
    merges_per_second_overall: float | None = Field(..., description="Merges per second since the job started")
    staleness: Staleness
    problems: JobProblems


class HostFigures(HostPublic):
    """A host on the operator's hosts page: its record, frameworks and what it has done."""

    frameworks: list[str]
    results_merged: int = Field(..., description="Its results merged into W_s, every job")
    examples: int = Field(..., description="Training examples in its merged results")
    examples_per_second: float | None = Field(..., description="Training throughput of its merged results")


class ProjectJob(BaseModel):
    """A job as volunteers see it: progress only."""

    name: str
    status: JobStatus
    current_epoch: int
    max_epochs: int | None
    best_accuracy: float | None = Field(..., description="The best validation accuracy measured")
    results_merged: int
    examples: int = Field(..., description="Training examples in its merged results")


class Volunteer(BaseModel):
    """One volunteer account's contribution: the hosts that registered under it count together (hosts
    with no account, as one "anonymous")."""

    name: str
    hosts: int
    results_merged: int
    results_valid: int
    examples: int
    credit: float = Field(..., description="Cobblestones earned by merged results (crowdtrain.core.credit)")


class ProjectPublic(BaseModel):
    """The public project page: the project's progress and its volunteers' contributions, no secrets."""

    jobs: list[ProjectJob]
    volunteers: list[Volunteer] = Field(..., description="Most credit first")
    hosts: list[HostCredit] = Field(..., description="Hosts by number, most credit first; no name or address")
    hosts_active: int = Field(..., description="Hosts seen in the last 2 minutes")
    results_merged: int
    examples: int
    credit: float = Field(..., description="Cobblestones earned by every host")
