"""Wire schemas: one pydantic model per request and per response of the `/v1` API."""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field


class Resources(BaseModel):
    cpus: int = Field(0, ge=0)
    ram_bytes: int = Field(0, ge=0)
    gpu: str = Field("", max_length=200)
    device: str = Field("cpu", max_length=50)
    frameworks: list[Literal["pytorch", "tensorflow"]] = Field(
        default_factory=lambda: ["pytorch"], min_length=1, max_length=8,
        description="Frameworks the client trains with (clients from before this field had PyTorch only)")


class HostRegister(BaseModel):
    join_token: str = Field(..., min_length=1, max_length=500)
    name: str = Field(..., min_length=1, max_length=200)
    resources: Resources = Field(default_factory=Resources)


class HostRegistered(BaseModel):
    host_id: int
    host_token: str


class JoinTokenCreate(BaseModel):
    label: str = Field(..., min_length=1, max_length=200, description="Who the token is for")


class JoinTokenCreated(BaseModel):
    id: int
    label: str
    token: str = Field(..., description="Shown once: only its hash is stored")


class JoinTokenPublic(BaseModel):
    id: int
    label: str
    created_at: datetime
    revoked: bool
    hosts_registered: int


class HostPublic(BaseModel):
    id: int
    name: str
    device: str
    cpus: int
    gpu: str
    created_at: datetime
    last_seen: datetime
    revoked: bool
    results_valid: int
    results_failed: int
    consecutive_valid: int
    mean_turnaround: float | None


class WorkRequest(BaseModel):
    free_slots: int = Field(..., ge=0, le=256)
    resources: Resources | None = None
    cached_shards: list[str] = Field(default_factory=list, max_length=100_000,
                                     description="sha256 of the shards in the host's cache")


class FileRef(BaseModel):
    url: str
    sha256: str
    size: int


class Recipe(BaseModel):
    """Everything a client needs to train: model (zoo name or Keras JSON, the job's framework, shapes,
    options) and training settings."""

    model: dict[str, Any]
    training: dict[str, Any]
    seed: int


class AssignmentOut(BaseModel):
    assignment_id: int
    job_id: int
    workunit_id: int
    epoch: int
    shard_index: int
    base_version: int
    deadline: datetime
    recipe: Recipe
    shard: FileRef
    snapshot: FileRef


class WorkReply(BaseModel):
    assignments: list[AssignmentOut]
    retry_after: float = Field(..., description="Seconds to wait before asking again when nothing was given")
    heartbeat_interval: float


class HeartbeatReply(BaseModel):
    keep_going: bool
    reason: str = ""


class ResultMetrics(BaseModel):
    train_loss: float | None = None
    examples: int | None = Field(None, ge=0)
    seconds: float | None = Field(None, ge=0)


class ResultAccepted(BaseModel):
    assignment_id: int
    status: str


class ClientError(BaseModel):
    message: str = Field(..., max_length=1000)


class JobCreated(BaseModel):
    job_id: int
    status: str
    shards: int
    parameters: int


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


class JobStatusOut(BaseModel):
    job_id: int
    name: str
    status: str
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
    assignments: dict[str, int]
    epochs: list[EpochFigures]
    metrics: list[MetricPoint] = Field(default_factory=list)
    elapsed_seconds: float | None
