"""Wire schemas of the operator's job API (`/v1/jobs`, `/v1/datasets`): a submitted job, its recipe
and signature, its status with its metrics, the list of jobs, a job's problems and its cancellation.
The types they share with every route (ids, hashes, keys, UTC datetimes) are crowdtrain.core.schemas'."""

from collections.abc import Iterable

from pydantic import BaseModel, Field

from crowdtrain.core.schemas import PublicKey, Sha256, Signature, UtcDatetime, WireRequest
from crowdtrain.core.states import AssignmentStatus, JobStatus


class DatasetStored(BaseModel):
    """An uploaded dataset in the scheduler's object storage; jobs name it as `FORMAT:sha256:HEX`."""

    sha256: Sha256
    created: bool = Field(..., description="False when the scheduler already had these bytes (nothing was sent)")


class JobCreated(BaseModel):
    job_id: int
    status: JobStatus
    shards: int
    parameters: int
    recipe: str = Field(..., description="The job's recipe (canonical JSON) for the operator's key to sign")
    signature_required: bool = Field(
        ...,
        description="True when the scheduler has a project key: the job stays pending until "
        "`POST /v1/jobs/{id}/signature` brings the recipe's signature",
    )


class JobRecipe(BaseModel):
    """A job's recipe, and its signature if it has one."""

    job_id: int
    status: JobStatus
    recipe: str
    public_key: PublicKey | None
    signature: Signature | None


class JobSignature(WireRequest):
    signature: Signature = Field(..., description="Ed25519 signature (base64) of the recipe's UTF-8 bytes")


class EpochFigures(BaseModel):
    epoch: int
    workunits: int
    done: int
    failed: int
    merges: int
    mean_accuracy: float | None = Field(
        ..., description="The epoch's figure: the mean validation accuracy of its merges"
    )
    min_accuracy: float | None
    max_accuracy: float | None

    @property
    def closed(self) -> bool:
        """Every workunit done or failed: the stop rule has judged (or will judge) its figure. An epoch
        still running, or cut short with its job (cancelled workunits), is not closed; a DeDLOC step has
        no workunits and is recorded once committed, so it is."""
        return self.done + self.failed == self.workunits


BEST_LABEL = "best of closed epochs"


def best_closed_epoch(epochs: Iterable[EpochFigures]) -> EpochFigures | None:
    """The closed epoch with the best figure (the first of equals); None before one has closed with a
    merge. The one definition of a job's best accuracy, wherever it is shown: an unfinished epoch's
    figure is a mean over the merges so far and does not count. No I/O."""
    closed = [e for e in epochs if e.closed and e.mean_accuracy is not None]
    return max(closed, key=lambda e: e.mean_accuracy or 0.0, default=None)


class MetricPoint(BaseModel):
    epoch: int
    param_version: int
    val_accuracy: float
    val_loss: float
    t: float = Field(..., description="Seconds since the job started")
    examples: int | None = Field(
        None,
        description="Training examples in the results merged into W_s up to this version "
        "(None where merges do not count them, as in dedloc mode)",
    )


class InFlightFigures(BaseModel):
    """Backpressure: the job's unmerged assignments against its in-flight budget."""

    count: int = Field(
        ..., description="Assignments dispatched or uploaded but not yet merged (prefetched ones included)"
    )
    budget: int | None = Field(
        ...,
        description="The most that may be in flight: scheduling.max_in_flight, or derived as max(rule floor, "
        "ceil(merge_rate x turnaround_seconds) + hosts holding the job's work); None until two merges measure "
        "the pace (no budget yet)",
    )
    derived: bool = Field(..., description="False when the spec sets scheduling.max_in_flight")
    held_back: bool = Field(
        ...,
        description="The job runs at its budget: hosts holding its work get no more of it until merges land "
        "(under a derived budget a host holding none may still get one)",
    )
    merge_rate: float | None = Field(None, description="Merges per second over the latest merges; None before two")
    turnaround_seconds: float | None = Field(
        None, description="Median seconds from dispatch to upload over the latest merges; None before two"
    )


class JobStatusOut(BaseModel):
    job_id: int
    name: str
    status: JobStatus
    status_message: str
    current_epoch: int
    param_version: int
    snapshot_version: int | None
    target_accuracy: float
    max_epochs: int
    best_epoch_accuracy: float | None = Field(
        ..., description="The best figure of the job's closed epochs (crowdtrain.core.schemas_jobs.best_closed_epoch)"
    )
    final_accuracy: float | None
    merges: int
    active_hosts: int
    assignments: dict[AssignmentStatus, int] = Field(
        ..., description="How many of the job's assignments are in each status"
    )
    epochs: list[EpochFigures]
    metrics: list[MetricPoint] = Field(default_factory=list)
    elapsed_seconds: float | None
    in_flight: InFlightFigures | None = Field(None, description="Backpressure; None in dedloc mode")
    mixture_id: int | None = Field(
        None,
        description="Mode moe: the mixture whose experts expert hosts serve (`crowdtrain expert-host --mixture ID`, "
        "`GET /v1/mixtures/{id}`); None in the other modes",
    )


class JobSummary(BaseModel):
    """One job in the list of jobs."""

    job_id: int
    name: str
    status: JobStatus
    current_epoch: int
    mode: str = "vc-asgd"
    max_epochs: int | None = None
    accuracy: float | None = Field(
        None, description="The exported model's validation accuracy once the job has ended, else the latest merge's"
    )
    created_at: UtcDatetime | None = None


class AssignmentProblem(BaseModel):
    """An assignment of the job that ended without a merge, and what it said."""

    assignment_id: int
    host_id: int
    host_name: str
    epoch: int
    status: AssignmentStatus
    message: str
    finished_at: UtcDatetime | None


class ProblemCount(BaseModel):
    status: AssignmentStatus
    reason: str = Field(..., description="The message with its particulars (numbers, times) left out")
    count: int


class JobProblems(BaseModel):
    """Why a job is stuck or failed: what its status says, the assignments that ended in an error, a
    refusal or a timeout (counted by reason, the recent ones in full), and whether hosts can run it."""

    job_id: int
    status: JobStatus
    status_message: str
    counts: dict[AssignmentStatus, int] = Field(..., description="Assignments that ended without a merge, by status")
    reasons: list[ProblemCount] = Field(..., description="The same, by reason, most frequent first")
    recent: list[AssignmentProblem] = Field(..., description="The latest of them, newest first")
    hosts_registered: int = Field(..., description="Hosts not revoked")
    hosts_able: int = Field(..., description="Hosts not revoked with a framework that trains the job's model")
    hosts_able_active: int = Field(..., description="Of those, the ones seen in the last minute")
    findings: list[str] = Field(..., description="What the figures above suggest, one sentence each")
    late: int = Field(
        0,
        description="Results uploaded and refused because the job had ended (succeeded, failed or cancelled) "
        "before their merge: the ordinary tail of a finished job, counted apart from the problems above",
    )
    late_recent: list[AssignmentProblem] = Field(default_factory=list, description="The latest of them, newest first")


class JobCancelled(BaseModel):
    job_id: int
    status: JobStatus
