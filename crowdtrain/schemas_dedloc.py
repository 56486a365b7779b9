"""Wire schemas of the synchronous DeDLOC mode's `/v1/dedloc` API (see server.dedloc)."""

from typing import Any, Literal

from pydantic import BaseModel, Field

from crowdtrain.schemas import INT32_MAX, INT64_MAX, WireRequest

PEER_ID = r"^[A-Za-z0-9_-]{1,64}$"


class PeerJoin(WireRequest):
    relayed: bool = Field(False, description="The peer cannot accept connections (NAT): the server reduces for it")


class ShardRef(BaseModel):
    id: int
    index: int
    sha256: str
    size: int
    examples: int


class PeerJoined(BaseModel):
    peer_id: str = Field(..., pattern=PEER_ID, description="The peer names its parts and rounds with it in URLs")
    job_id: int
    recipe: dict[str, Any] = Field(..., description="model config, dedloc spec, seed, max_steps")
    shards: list[ShardRef]
    step: int = Field(..., description="The step the collaboration is accumulating")
    state_step: int = Field(..., description="The newest uploaded state: parameters at the start of this step")


class Progress(WireRequest):
    peer_id: str = Field(..., pattern=PEER_ID)
    step: int = Field(..., ge=-1, le=INT32_MAX, description="The step the peer accumulates for; -1 before its first state")
    examples: int = Field(0, ge=0, le=1_000_000_000, description="Examples accumulated for `step`")
    attempt: int | None = Field(None, ge=0, le=INT32_MAX, description="The attempt the peer last reduced in, if any")
    params_digest: str | None = Field(None, max_length=64, description="sha256 of the peer's parameters at `step`")


class RoundPlanOut(BaseModel):
    step: int
    attempt: int
    members: list[str]
    examples: dict[str, int]
    total: int
    relayed: bool
    group: int | None
    group_members: list[str]
    rank: int | None
    needs_combining: bool
    parts: list[str]
    averaging_timeout: float


Action = Literal["accumulate", "matchmaking", "reduce", "wait", "apply", "resync", "stop"]


class ProgressReply(BaseModel):
    action: Action
    step: int = Field(..., description="The step the collaboration is accumulating")
    state_step: int
    round: RoundPlanOut | None = None
    upload_state: bool = Field(False, description="With `apply`: this peer uploads the state after the step")
    accumulated: int = Field(0, description="Examples the live peers have reported for `step` so far")
    peers: int = Field(1, description="Live peers: a peer reports as soon as it holds its share of the batch")
    message: str = ""


class RoundReport(WireRequest):
    peer_id: str = Field(..., pattern=PEER_ID)
    ok: bool
    result_digest: str = Field("", max_length=64)
    message: str = Field("", max_length=1000)


class StoreOp(WireRequest):
    """One torch.distributed Store call (values base64-encoded)."""

    peer_id: str = Field(..., pattern=PEER_ID)
    key: str = Field("", max_length=500)
    value: str | None = Field(None, max_length=1_000_000)
    amount: int = Field(0, ge=-INT64_MAX, le=INT64_MAX, description="add: the increment (a 64-bit counter)")
    expected: str | None = Field(None, max_length=1_000_000)
    keys: list[str] = Field(default_factory=list, max_length=10_000)
    wait: float = Field(0.0, ge=0, le=5, description="get/check: seconds the server may wait for the key(s)")


class StoreReply(BaseModel):
    value: str | None = None
    number: int | None = None
    found: bool = True


class ReplyOk(BaseModel):
    status: str
    message: str = ""
