"""Wire schemas of the dashboard: the operator's job and hosts pages (`/dashboard/api`) and the public
project page (`/v1/project`), which shows progress and credit and no secrets."""

from typing import Literal

from pydantic import BaseModel, Field

from crowdtrain.core.schemas import HostPublic, UtcDatetime
from crowdtrain.core.schemas_jobs import InFlightFigures, JobProblems, JobStatusOut
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
    mode: str = Field(..., description="vc-asgd or dedloc: which section the page adds (in flight, or DeDLOC rounds)")
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
    best_accuracy: float | None = Field(
        ...,
        description="The best figure (mean validation accuracy) of the job's closed epochs; an epoch still "
        "running does not count",
    )
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


ExpectedFrom = Literal["host", "job", "deadline"]


class RunningAssignment(BaseModel):
    """An assignment out with its host (in progress): how long it has run and when it should be back."""

    assignment_id: int
    workunit_id: int
    epoch: int
    host_id: int
    host_name: str
    sent_at: UtcDatetime
    age_seconds: float = Field(..., description="Seconds since it was sent")
    deadline: UtcDatetime
    expected_finish: UtcDatetime = Field(
        ..., description="sent_at + the measured turnaround (`expected_from`), never past the deadline"
    )
    expected_from: ExpectedFrom = Field(
        ...,
        description="host: the host's mean turnaround over its valid results; job: the job's median turnaround "
        "over its latest merges; deadline: neither is measured yet",
    )
    straggler: bool = Field(..., description="Running longer than `straggler_factor` x the job's median")
    duplicate: bool = Field(..., description="Its workunit has another assignment running")


class JobInFlight(BaseModel):
    """What a job is waiting on: its running assignments, its results waiting for their merge, its
    stragglers and duplicated workunits."""

    job_id: int
    running: list[RunningAssignment] = Field(..., description="Oldest first, at most `running_shown` of them")
    running_total: int = Field(..., description="Every assignment of the job in progress")
    running_shown: int
    merge_backlog: int = Field(..., description="Results uploaded and not yet merged (nor refused)")
    oldest_upload_seconds: float | None = Field(..., description="Seconds the oldest of them has waited")
    in_flight: InFlightFigures | None = Field(..., description="Backpressure: unmerged count against the budget")
    median_seconds: float | None = Field(
        ..., description="Median seconds from dispatch to upload of the job's finished (merged) assignments"
    )
    straggler_factor: float
    stragglers: int = Field(..., description="Running assignments older than straggler_factor x median_seconds")
    duplicates: list[int] = Field(..., description="Workunits with more than one assignment running")


class DedlocStep(BaseModel):
    """One committed step of a DeDLOC job."""

    step: int
    attempt: int = Field(..., description="Attempts aborted before it committed")
    members: int
    examples: int = Field(..., description="Examples its members averaged gradients over")
    seconds: float | None = Field(..., description="Since the previous step's commit; None for the first recorded")


class DedlocFigures(BaseModel):
    """A DeDLOC job's rounds on the operator's job page."""

    job_id: int
    phase: str = Field(..., description="The running step's phase: accumulating, matchmaking or reducing")
    step: int = Field(..., description="The step running now")
    steps_committed: int
    max_steps: int
    peers_live: int = Field(..., description="Peers heard from within the liveness window")
    members_last: int | None = Field(..., description="Members of the latest committed step")
    members_seen: int = Field(..., description="Distinct peers that were members of a committed step")
    mean_round_seconds: float | None = Field(..., description="Mean time between consecutive commits")
    target_batch_size: int
    examples_per_step: float | None = Field(..., description="Mean examples of a committed step")
    examples_min: int | None
    examples_max: int | None
    overshoot: float | None = Field(..., description="Mean examples of a step beyond target_batch_size")
    recent: list[DedlocStep] = Field(..., description="The latest committed steps, newest first")
