"""Wire schemas: one pydantic model per request and per response of the `/v1` API. This module holds
the types every route shares and the schemas of hosts, work, results and the project key; the job
API's are in crowdtrain.core.schemas_jobs, the dashboard's in crowdtrain.core.schemas_dashboard and
the DeDLOC mode's in crowdtrain.core.schemas_dedloc.

Untrusted input is typed here once: request bodies are strict (no `false` for 0, no "3" for 3),
floats are finite, and every integer that reaches the database is bounded to its column, so that no
value a client sends can overflow a driver. Datetimes leave the server as UTC with an offset.
Statuses in answers are the StrEnums of crowdtrain.core.states: on the wire they are their values.
"""

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, StringConstraints, computed_field

from crowdtrain.core.assimilationspec import UploadSpec
from crowdtrain.core.frameworks import Framework
from crowdtrain.core.reputation import score
from crowdtrain.core.states import AssignmentStatus

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
    account: str = Field(
        "",
        max_length=64,
        pattern=r"^[A-Za-z0-9 ._@+-]*$",
        description="The volunteer account the token is issued to: every host registered with it is under this "
        "account, whatever account it names (empty: a project-wide token, whose hosts name their own)",
    )
    registrations_per_hour: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Hosts the token may register in any hour (None: the scheduler's "
        "CROWDTRAIN_REGISTRATIONS_PER_HOUR_PER_TOKEN)",
    )


class JoinTokenCreated(BaseModel):
    id: int
    label: str
    account: str = ""
    registrations_per_hour: int | None = None
    token: str = Field(..., description="Shown once: only its hash is stored")


class JoinTokenPublic(BaseModel):
    id: int
    label: str
    account: str
    registrations_per_hour: int | None
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
    credit: float = Field(
        ...,
        description="Cobblestones earned by merged results, and by answers to trainers as an expert host "
        "(crowdtrain.core.credit)",
    )
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
    bind_at_start: bool = Field(
        False,
        description="Ask for the newest snapshot (POST /v1/assignments/{id}/start) when a compute slot starts "
        "this assignment, and train from the snapshot the answer names (the job's scheduling.snapshot_binding)",
    )


# The shortest interval between one assignment's heartbeats, in seconds: a work reply derives none
# shorter from a lease (crowdtrain.server.services.results.heartbeat_interval), and a client waits
# at least this long whatever a reply names (crowdtrain.client.assignment.Running.heartbeat_is_due).
MIN_HEARTBEAT_S = 1.0


class WorkReply(BaseModel):
    assignments: list[AssignmentOut]
    retry_after: float = Field(..., description="Seconds to wait before asking again when nothing was given")
    heartbeat_interval: float
    key_rotations: list[KeyRotation] = Field(
        default_factory=list,
        max_length=1000,
        description="Every rotation of the project key, oldest first: a client follows them from the key it trusts",
    )


class SnapshotBound(BaseModel):
    """The snapshot an assignment trains from, as the scheduler recorded it when its slot started."""

    base_version: int
    snapshot: FileRef | None = Field(
        None, description="The snapshot's file; None: the one the assignment was dispatched with (`base_version`)"
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


class ProjectKeySet(WireRequest):
    public_key: PublicKey


class ProjectKeyOut(BaseModel):
    public_key: PublicKey | None = Field(..., description="The key that signs the project's work now (None: none)")
    key_id: str | None = Field(..., description="A short name of it: the first 16 hex digits of its sha256")
    rotations: list[KeyRotation] = Field(..., description="Every rotation so far, oldest first")


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class HealthPart(BaseModel):
    ok: bool
    detail: str = Field("", description="Why it is not ok")
    processes: int | None = Field(None, description="Processes of this kind whose health record is live")
    newest_age_seconds: float | None = Field(None, description="Seconds since the newest of them reported")


class HealthReport(BaseModel):
    status: Literal["ok", "degraded"] = Field(..., description="ok: every part is; degraded: one is not (503)")
    parts: dict[str, HealthPart] = Field(
        ..., description="database, redis, storage, and each kind of process: scheduler, parameter-server, transitioner"
    )
