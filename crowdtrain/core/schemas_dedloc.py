"""Wire schemas of the synchronous DeDLOC mode's `/v1/dedloc` API (see crowdtrain.server.services.dedloc)."""

import binascii
from base64 import b64decode
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field

from crowdtrain.core.schemas import INT32_MAX, INT64_MAX, KeyRotation, SignedRecipe, WireRequest

PEER_ID = r"^[A-Za-z0-9_-]{1,64}$"
STORE_VALUE_CHARS = 1_000_000  # a Store value's base64 (750,000 bytes): rendezvous keys and small blobs
MAX_PROGRESS_WAIT = 10.0  # seconds a progress report may be held open (Progress.wait)
BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


def _strict_base64(value: str) -> str:
    """Standard base64 with its padding, nothing else: what the server decodes is what was sent."""
    try:
        b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(
            f"is not base64 (standard alphabet A-Z a-z 0-9 + /, padded with = to a multiple of 4): {exc}"
        ) from None
    return value


Base64Value = Annotated[
    str,
    Field(max_length=STORE_VALUE_CHARS, json_schema_extra={"pattern": BASE64}),
    AfterValidator(_strict_base64),
]


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
    signed: SignedRecipe | None = Field(
        None,
        description="The job's signed recipe, which `recipe`, `shards` and the state of step 0 must agree with; "
        "None: unsigned",
    )
    key_rotations: list[KeyRotation] = Field(
        default_factory=list,
        description="Every rotation of the project key, oldest first: a peer follows them from the key it trusts",
    )


class PeerRefusal(WireRequest):
    """A peer will not train the job it joined: its recipe is unsigned, or not signed by the key it trusts."""

    peer_id: str = Field(..., pattern=PEER_ID)
    message: str = Field(..., max_length=1000)


class Progress(WireRequest):
    peer_id: str = Field(..., pattern=PEER_ID)
    step: int = Field(
        ..., ge=-1, le=INT32_MAX, description="The step the peer accumulates for; -1 before its first state"
    )
    examples: int = Field(0, ge=0, le=1_000_000_000, description="Examples accumulated for `step`")
    attempt: int | None = Field(None, ge=0, le=INT32_MAX, description="The attempt the peer last reduced in, if any")
    params_digest: str | None = Field(None, max_length=64, description="sha256 of the peer's parameters at `step`")
    wait: float = Field(
        0.0,
        ge=0,
        le=MAX_PROGRESS_WAIT,
        description="Seconds the scheduler may hold the answer while it would only say to go on waiting "
        "(matchmaking, or wait for the others' outcomes): it answers as soon as the round moves",
    )


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
    session: str | None = Field(
        None, description="The group's process-group session: a member that holds it reuses its process group"
    )
    new_session: bool = Field(True, description="The session starts in this attempt: its members rendezvous first")
    needs_combining: bool
    parts: list[str]
    averaging_timeout: float


class PeerAction(StrEnum):
    """What a peer does next, as the rendezvous answers its progress report."""

    accumulate = "accumulate"
    matchmaking = "matchmaking"
    reduce = "reduce"
    wait = "wait"
    apply = "apply"
    resync = "resync"
    stop = "stop"


class ProgressReply(BaseModel):
    action: PeerAction
    step: int = Field(..., description="The step the collaboration is accumulating")
    state_step: int
    round: RoundPlanOut | None = None
    upload_state: bool = Field(
        False,
        description="This peer uploads its state of `step` now: it is a member of the commit of `step` - 1 and holds "
        "the parameters most of its members report (never with `apply`: members report their parameters first)",
    )
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
    value: Base64Value | None = Field(None, description="set, compare_set: the value, base64")
    amount: int = Field(0, ge=-INT64_MAX, le=INT64_MAX, description="add: the increment (a 64-bit counter)")
    expected: Base64Value | None = Field(None, description="compare_set: the value expected, base64")
    keys: list[str] = Field(default_factory=list, max_length=10_000)
    wait: float = Field(0.0, ge=0, le=5, description="get/check: seconds the server may wait for the key(s)")


class StoreReply(BaseModel):
    value: str | None = None
    number: int | None = None
    found: bool = True


class Outcome(StrEnum):
    """What became of a report or an upload to the rendezvous."""

    recorded = "recorded"  # a member's report, kept until every member has reported
    committed = "committed"  # the report that completed the round: the step is committed
    aborted = "aborted"  # a failed reduction: the attempt is aborted for every member
    stored = "stored"  # an upload kept
    combined = "combined"  # the part that completed the round's sum
    duplicate = "duplicate"  # a state already uploaded by another peer: nothing changed


class ReplyOk(BaseModel):
    status: Outcome
    message: str = ""


class StoreOpName(StrEnum):
    """The torch.distributed Store calls the rendezvous serves."""

    set = "set"
    get = "get"
    add = "add"
    check = "check"
    compare_set = "compare_set"
    delete = "delete"


class CommitOut(BaseModel):
    """How a step was committed."""

    step: int
    attempt: int
    members: list[str]
    examples: dict[str, int]
    digest: str = Field(..., description="sha256 of the averaged gradient every member applied")
    uploader: str = Field(..., description="The member that uploads the state after the step")
    at: float = Field(..., description="Unix time of the commit")


class AbortOut(BaseModel):
    """An aborted attempt of a step."""

    members: list[str]
    reason: str
    at: float = Field(..., description="Unix time of the abort")
