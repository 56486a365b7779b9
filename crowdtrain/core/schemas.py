"""Wire schemas: one pydantic model per request and per response of the `/v1` API.

Untrusted input is typed here once: request bodies are strict (no `false` for 0, no "3" for 3),
floats are finite, and every integer that reaches the database is bounded to its column, so that no
value a client sends can overflow a driver. Datetimes leave the server as UTC with an offset.
Statuses in answers are the StrEnums of crowdtrain.core.states: on the wire they are their values.
"""

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, StringConstraints, computed_field

from crowdtrain.core.frameworks import Framework
from crowdtrain.core.jobspec import UploadSpec
from crowdtrain.core.reputation import score
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Database ids (path parameters, body fields): non-negative and within a 64-bit column, so that a
# larger value is a 422 instead of an OverflowError from the driver.
Id = Annotated[int, at.Interval(ge=0, le=INT64_MAX)]
Count = Annotated[int, at.Interval(ge=0, le=INT32_MAX)]
Bytes = Annotated[int, at.Interval(ge=0, le=INT64_MAX)]
Finite = Annotated[float, AllowInfNan(False)]
# A file's content address; clients name cache files by it, so nothing else may pass for one.
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


def _as_utc(value: datetime) -> datetime:
    # The database stores naive UTC; the wire always says so.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]


class WireRequest(BaseModel):
    """A JSON request body: strict types and finite floats."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class ErrorOut(BaseModel):
    """Every 4xx/5xx answer of the API."""

    detail: str = Field(..., description="What was wrong, naming the field or resource")


def _pytorch_only() -> list[Framework]:
    return ["pytorch"]


class Resources(WireRequest):
    cpus: Count = 0
    ram_bytes: Bytes = 0
    gpu: str = Field("", max_length=200)
    device: str = Field("cpu", max_length=50)
    frameworks: list[Framework] = Field(
        default_factory=_pytorch_only,
        min_length=1,
        max_length=8,
        description="Frameworks the client trains with (clients from before this field had PyTorch only)",
    )


class HostRegister(WireRequest):
    join_token: str = Field(..., min_length=1, max_length=500)
    name: str = Field(..., min_length=1, max_length=200)
    resources: Resources = Field(default_factory=Resources)
    account: str = Field(
        "",
        max_length=64,
        pattern=r"^[A-Za-z0-9 ._@+-]*$",
        description="The volunteer account the host's credit adds up under, shown on the public project page "
        "(letters, digits, space and ._@+-; empty: none)",
    )


# A project public key: base64 of 32 raw Ed25519 bytes (crowdtrain.core.signing); a signature, of 64.
PublicKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9+/]{43}=$")]
Signature = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9+/]{86}==$")]


class HostRegistered(BaseModel):
    host_id: int
    host_token: str = Field(..., max_length=500)
    project_public_key: PublicKey | None = Field(
        None,
        description="The project's current public key, which signs its work (None: the project signs nothing); "
        "a client given no key pins it (trust on first use)",
    )
    download_origins: list[Annotated[str, Field(max_length=300)]] = Field(
        default_factory=list,
        max_length=8,
        description="Origins (scheme://host:port) of the object store that presigned shard and snapshot URLs "
        "name; the client pins them at registration",
    )


class JoinTokenCreate(WireRequest):
    label: str = Field(..., min_length=1, max_length=200, description="Who the token is for")


class JoinTokenCreated(BaseModel):
    id: int
    label: str
    token: str = Field(..., description="Shown once: only its hash is stored")


class JoinTokenPublic(BaseModel):
    id: int
    label: str
    created_at: UtcDatetime
    revoked: bool
    hosts_registered: int


class HostPublic(BaseModel):
    id: int
    name: str
    device: str
    cpus: int
    gpu: str
    created_at: UtcDatetime
    last_seen: UtcDatetime
    revoked: bool
    results_valid: int
    results_failed: int
    consecutive_valid: int
    mean_turnaround: float | None
    account: str
    credit: float = Field(..., description="Cobblestones earned by merged results (crowdtrain.core.credit)")
    consecutive_refused: int
    quarantined_until: UtcDatetime | None = Field(
        ..., description="No work for the host until then (repeated refusals); release it to end it sooner"
    )
    quarantine_reason: str

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reputation(self) -> float:
        """The share of valid results, a new host starting at 0.5 (crowdtrain.core.reputation.score)."""
        return score(self.results_valid, self.results_failed)


class HostCredit(BaseModel):
    """A host as the public sees it: no name, address or token."""

    host_id: int
    account: str
    credit: float
    results: int = Field(..., description="Results merged into a model")


class WorkRequest(WireRequest):
    free_slots: int = Field(..., ge=0, le=256)
    resources: Resources | None = None
    cached_shards: list[Sha256] = Field(
        default_factory=list, max_length=100_000, description="sha256 of the shards in the host's cache"
    )
    refused_jobs: list[Id] = Field(
        default_factory=list,
        max_length=10_000,
        description="Jobs whose work this host has refused (its recipe unsigned or not signed by the key the "
        "host trusts): the scheduler sends it none of their work",
    )


class FileRef(BaseModel):
    url: str = Field(..., max_length=4096, description="Relative to the scheduler, or presigned on the object store")
    sha256: Sha256
    size: int = Field(..., ge=0, description="Bytes; a client stops a download that runs past it")


class Recipe(BaseModel):
    """Everything a client needs to train: model (zoo name or Keras JSON, the job's framework, shapes,
    options) and training settings, and how to send the result back (crowdtrain.core.updates)."""

    model: dict[str, Any]
    training: dict[str, Any]
    seed: int
    upload: UploadSpec = Field(
        default_factory=UploadSpec,
        description="The job's assimilation.upload: weights or the update Δ, and its encoding",
    )


class SignedRecipe(BaseModel):
    """A job's recipe as the operator signed it (crowdtrain.core.signing.recipe_document): its canonical
    JSON text, the public key that signed it and the signature of the text's UTF-8 bytes."""

    recipe: str = Field(..., max_length=16 * 2**20)
    public_key: PublicKey
    signature: Signature


class KeyRotation(WireRequest):
    """The project key moves from `old_public_key` to `new_public_key`: signed by the old private key
    (crowdtrain.core.signing.sign_rotation)."""

    old_public_key: PublicKey
    new_public_key: PublicKey
    signature: Signature


class AssignmentOut(BaseModel):
    assignment_id: int
    job_id: int
    workunit_id: int
    epoch: int
    shard_index: int
    base_version: int
    deadline: UtcDatetime
    local_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Train this share of the recipe's local epochs' "
        "steps (at least one step): training."
        "dynamic_local_work gives slower hosts less",
    )
    recipe: Recipe
    shard: FileRef
    snapshot: FileRef
    signed: SignedRecipe | None = Field(
        None, description="The job's signed recipe, which `recipe`, `shard` and `seed` must agree with; None: unsigned"
    )


class WorkReply(BaseModel):
    assignments: list[AssignmentOut]
    retry_after: float = Field(..., description="Seconds to wait before asking again when nothing was given")
    heartbeat_interval: float
    key_rotations: list[KeyRotation] = Field(
        default_factory=list,
        max_length=1000,
        description="Every rotation of the project key, oldest first: a client follows them from the key it trusts",
    )


class HeartbeatReply(BaseModel):
    keep_going: bool
    reason: str = ""
    deadline: UtcDatetime | None = Field(
        None, description="The assignment's deadline after this heartbeat (it extends a live lease, up to a bound)"
    )


class ResultMetrics(BaseModel):
    """Metrics of an upload; they ride in its query string (so not strict: query values are text)."""

    model_config = ConfigDict(allow_inf_nan=False)

    train_loss: float | None = None
    examples: Count | None = None
    seconds: float | None = Field(None, ge=0)


class ResultAccepted(BaseModel):
    assignment_id: int
    status: AssignmentStatus


class ClientError(WireRequest):
    message: str = Field(..., max_length=1000)


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


class ProjectKeySet(WireRequest):
    public_key: PublicKey


class ProjectKeyOut(BaseModel):
    public_key: PublicKey | None = Field(..., description="The key that signs the project's work now (None: none)")
    key_id: str | None = Field(..., description="A short name of it: the first 16 hex digits of its sha256")
    rotations: list[KeyRotation] = Field(..., description="Every rotation so far, oldest first")


class EpochFigures(BaseModel):
    epoch: int
    workunits: int
    done: int
    failed: int
    merges: int
    mean_accuracy: float | None
    min_accuracy: float | None
    max_accuracy: float | None


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
    best_epoch_accuracy: float | None
    final_accuracy: float | None
    merges: int
    active_hosts: int
    assignments: dict[AssignmentStatus, int] = Field(
        ..., description="How many of the job's assignments are in each status"
    )
    epochs: list[EpochFigures]
    metrics: list[MetricPoint] = Field(default_factory=list)
    elapsed_seconds: float | None


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


class JobCancelled(BaseModel):
    job_id: int
    status: JobStatus


class Health(BaseModel):
    status: Literal["ok"] = "ok"


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
