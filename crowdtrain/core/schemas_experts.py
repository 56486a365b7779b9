"""Wire schemas of expert-parallel training's registry (`/v1/mixtures`): mixtures, the leases of
expert hosts, and the routing table trainers follow."""

from pydantic import BaseModel, Field

from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.schemas import UtcDatetime

# An expert host's base URL as the scheduler and trainers call it: scheme, host and port, no path.
HOST_URL_PATTERN = r"^https?://[A-Za-z0-9.\-\[\]:]{1,253}$"


class MixtureCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    layout: ExpertLayout


class MixtureCreated(BaseModel):
    mixture_id: int


class LeaseRequest(BaseModel):
    """An expert host's call: it serves at `url` and has room for `capacity` experts in all."""

    url: str = Field(
        max_length=300, pattern=HOST_URL_PATTERN, description="the host's base URL, e.g. http://10.0.0.5:8800"
    )
    capacity: int = Field(ge=0, le=4096, description="experts this host can serve (its memory's share)")


class LeaseOut(BaseModel):
    uid: str
    replica: int = Field(0, description="which of the expert's replicas the host serves")
    expires_in: float = Field(description="seconds the lease lasts unless the host calls again")
    checkpoint_step: int = Field(description="the step of the expert's newest checkpoint (of any replica); 0 with none")
    has_checkpoint: bool
    peer_step: int = Field(
        0, description="the step of the newest checkpoint of the expert's other replicas, to average with; 0 with none"
    )


class Leases(BaseModel):
    """Every expert the host serves from now on: any it served before and is not listed here is lost."""

    mixture_id: int
    layout: ExpertLayout
    heartbeat_seconds: float
    leases: list[LeaseOut]


class RouteOut(BaseModel):
    uid: str
    replica: int = Field(0, description="which of the expert's replicas")
    url: str | None = Field(description="where to call the replica; null while no host serves it")


class RoutingTable(BaseModel):
    version: int = Field(description="ask again with since= this version for what changes next")
    routes: list[RouteOut]


_COUNT = 1_000_000_000  # bounds a reported count: far above what one report's window can hold


class ExpertCalls(BaseModel):
    """What one trainer's calls to one expert at one host came to, over a report's window."""

    uid: str = Field(max_length=40, pattern=r"^\d{1,4}(\.\d{1,4}){1,4}$", description="the expert")
    url: str = Field(max_length=300, pattern=HOST_URL_PATTERN, description="the host the calls went to")
    answered: int = Field(0, ge=0, le=_COUNT, description="calls answered with a usable answer")
    rows: int = Field(0, ge=0, le=_COUNT, description="rows those answers carried (forward and backward)")
    failed: int = Field(0, ge=0, le=_COUNT, description="calls that got no answer: an error status or no connection")
    late: int = Field(0, ge=0, le=_COUNT, description="calls dropped unanswered when the trainer stopped waiting")
    refused: int = Field(
        0, ge=0, le=_COUNT, description="answers the trainer refused: not safetensors, wrong shapes, NaN, too large"
    )
    compared: int = Field(
        0, ge=0, le=_COUNT, description="answers compared with another replica's answer to the same call"
    )
    disagreed: int = Field(
        0,
        ge=0,
        le=_COUNT,
        description="answers that disagreed with another replica's beyond the tolerance and that the trainer "
        "blames on this host: of the two, its answers agreed less often over all the trainer compared",
    )


class CallReport(BaseModel):
    """A trainer's calls to a mixture's experts since its last report (`POST /v1/mixtures/{id}/calls`):
    what counts the hosts' credit and charges their refused answers."""

    seconds: float = Field(gt=0, le=86_400, description="the window the counts cover")
    experts: list[ExpertCalls] = Field(max_length=4096)


class CallsRecorded(BaseModel):
    counted: int = Field(description="entries counted: the expert's current host, another host than the reporter")
    ignored: int = Field(description="entries left out: an expert the host no longer serves, or the reporter's own")


class ExpertOut(BaseModel):
    uid: str
    replica: int = Field(0, description="which of the expert's replicas this row is")
    host_id: int | None
    url: str | None
    lease_expires_at: UtcDatetime | None
    leases: int = Field(description="leases granted: 1 + the times it moved to another host")
    checkpoint_step: int
    checkpoint_at: UtcDatetime | None
    answered: int = Field(0, description="calls trainers reported answered, by every host it had")
    failed: int = Field(0, description="calls trainers reported unanswered (error status, no connection)")
    late: int = Field(0, description="calls trainers stopped waiting for")
    refused: int = Field(0, description="answers trainers refused (NaN, wrong shapes): charged to the host")
    compared: int = Field(0, description="answers trainers compared with another replica's")
    disagreed: int = Field(0, description="answers trainers blamed for disagreeing with another replica's: charged")
    answers_per_s: float | None = Field(
        None, description="answered calls per second over the span of the reports; None before any report"
    )


class MixtureOut(BaseModel):
    mixture_id: int
    name: str
    status: str
    layout: ExpertLayout
    route_version: int
    served: int = Field(description="replicas a host serves now (experts, with one replica each)")
    experts: list[ExpertOut]


class CheckpointStored(BaseModel):
    uid: str
    step: int
