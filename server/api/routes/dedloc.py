"""`/v1/dedloc`: the rendezvous of the synchronous DeDLOC mode (peers use their host token)."""

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from crowdtrain.core.schemas import INT32_MAX, Id
from crowdtrain.core.schemas_dedloc import (
    AbortOut,
    CommitOut,
    Outcome,
    PeerJoin,
    PeerJoined,
    PeerRefusal,
    Progress,
    ProgressReply,
    ReplyOk,
    RoundReport,
    StoreOp,
    StoreOpName,
    StoreReply,
)
from crowdtrain.server.api.boundary import (
    UPLOAD_RESPONSES,
    BodyTooLarge,
    fixed_chunks,
    octet_stream_body,
    upload_body,
)
from crowdtrain.server.api.deps import (
    AdminDep,
    DbDep,
    EvaluatorDep,
    HostDep,
    NowDep,
    RedisDep,
    SettingsDep,
    StorageDep,
)
from crowdtrain.server.services import dedloc_jobs, dedloc_relay, dedloc_rounds, dedloc_states

router = APIRouter(prefix="/v1/dedloc/jobs/{job_id}", tags=["dedloc"])
admin_router = APIRouter(prefix="/v1/dedloc/jobs/{job_id}", tags=["dedloc", "admin"], dependencies=[AdminDep])


@router.post("/join", response_model=PeerJoined)
def join(job_id: Id, req: PeerJoin, host_id: HostDep, db: DbDep, r: RedisDep, now: NowDep) -> PeerJoined:
    """Join the collaboration; the answer names the recipe, the shards and the step to sync to."""
    return dedloc_jobs.join(db, r, job_id, host_id, req.relayed, now)


@router.post("/refusal", response_model=ReplyOk)
def refuse(job_id: Id, req: PeerRefusal, host_id: HostDep, r: RedisDep, now: NowDep) -> ReplyOk:
    """The peer will not train this job (its recipe is unsigned, or not signed by the key the peer
    trusts): it leaves the collaboration, and the job's problems show why. 403 for a peer that has not
    joined (or is another host's)."""
    dedloc_jobs.refuse(r, job_id, host_id, req, now)
    return ReplyOk(status=Outcome.recorded)


@router.post("/progress", response_model=ProgressReply)
def progress(job_id: Id, req: Progress, host_id: HostDep, db: DbDep, r: RedisDep, now: NowDep) -> ProgressReply:
    """Report the examples accumulated for the current step; the answer says what to do next."""
    return dedloc_rounds.progress(db, r, job_id, host_id, req, now)


@router.post("/rounds/{step}/{attempt}/report", response_model=ReplyOk)
def report(
    job_id: Id, step: Id, attempt: Id, req: RoundReport, host_id: HostDep, db: DbDep, r: RedisDep, now: NowDep
) -> ReplyOk:
    """A member's outcome of its reduction; a failure aborts the attempt for every member."""
    return ReplyOk(
        status=dedloc_rounds.report(
            db, r, job_id, host_id, step, attempt, req.peer_id, req.ok, req.result_digest, req.message, now
        )
    )


@router.post("/rounds/{step}/{attempt}/store/{op}", response_model=StoreReply)
def store(
    job_id: Id, step: Id, attempt: Id, op: str, req: StoreOp, host_id: HostDep, r: RedisDep, now: NowDep
) -> StoreReply:
    """The torch.distributed Store of the caller's all-reduce group (a prefix per job, step, attempt, group)."""
    if op not in StoreOpName.__members__:
        known = ", ".join(StoreOpName)
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown store operation {op!r}; known: {known}")
    return dedloc_rounds.store_op(r, job_id, host_id, step, attempt, op, req, now)


@router.put(
    "/rounds/{step}/{attempt}/parts/{part}",
    response_model=ReplyOk,
    responses=UPLOAD_RESPONSES,
    openapi_extra=octet_stream_body("`size` float32, raw little-endian, streamed"),
)
async def put_part(
    job_id: Id,
    step: Id,
    attempt: Id,
    part: str,
    peer_id: str,
    size: Annotated[int, Query(ge=1, le=INT32_MAX)],
    request: Request,
    host_id: HostDep,
    r: RedisDep,
    settings: SettingsDep,
    now: NowDep,
) -> ReplyOk:
    """A group's sum or a relayed member's weighted gradient, streamed: stored and summed chunk by chunk."""
    if 4 * size > settings.upload_max_bytes:
        raise BodyTooLarge(settings.upload_max_bytes, 4 * size)
    parts = await run_in_threadpool(
        dedloc_relay.check_part, r, job_id, host_id, peer_id, step, attempt, part, size, now
    )
    outcome, index = Outcome.stored, 0
    async for chunk in fixed_chunks(request, dedloc_relay.CHUNK_BYTES, 4 * size):
        if await run_in_threadpool(dedloc_relay.put_chunk, r, job_id, step, attempt, parts, part, index, chunk):
            outcome = Outcome.combined
        index += 1
    return ReplyOk(status=outcome)


@router.get(
    "/rounds/{step}/{attempt}/total",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "`size` float32, streamed"}},
)
def get_total(
    job_id: Id,
    step: Id,
    attempt: Id,
    peer_id: str,
    size: Annotated[int, Query(ge=1, le=INT32_MAX)],
    host_id: HostDep,
    r: RedisDep,
    now: NowDep,
) -> StreamingResponse:
    """The sum of every part of the round, streamed as it is summed; a body shorter than `size`
    float32 means the attempt ended before its total was complete."""
    chunks = dedloc_relay.total_chunks(r, job_id, host_id, peer_id, step, attempt, size, now)
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.put(
    "/states/{step}",
    response_model=ReplyOk,
    responses=UPLOAD_RESPONSES,
    openapi_extra=octet_stream_body("Parameters and optimizer state (safetensors)"),
)
async def put_state(
    job_id: Id,
    step: Id,
    peer_id: str,
    request: Request,
    host_id: HostDep,
    db: DbDep,
    r: RedisDep,
    storage: StorageDep,
    settings: SettingsDep,
    evaluator: EvaluatorDep,
    now: NowDep,
) -> ReplyOk:
    """Parameters and optimizer state at the start of `step` (safetensors); evaluated and recorded."""
    async with upload_body(request, settings.upload_max_bytes) as body:
        return ReplyOk(
            status=await run_in_threadpool(
                dedloc_jobs.put_state, db, r, storage, evaluator, job_id, host_id, peer_id, step, body, now
            )
        )


@router.get("/states/latest", response_class=Response)
def latest_state(job_id: Id, host_id: HostDep, r: RedisDep, storage: StorageDep) -> Response:
    """The newest state, for members of the collaboration; its step is in the `X-Crowdtrain-Step` header."""
    step, blob = dedloc_jobs.latest_state(r, storage, job_id, host_id)
    return Response(blob, media_type="application/octet-stream", headers={"X-Crowdtrain-Step": str(step)})


@admin_router.get("/digests/{step}", response_model=dict[str, str])
def digests(job_id: Id, step: Id, r: RedisDep) -> dict[str, str]:
    """Peer id -> sha256 of the parameters that peer held at the start of `step`."""
    return dedloc_jobs.digests(r, job_id, step)


@admin_router.get("/state-refusals", response_model=dict[str, int])
def state_refusals(job_id: Id, r: RedisDep) -> dict[str, int]:
    """Peer id -> how many of its uploaded states were refused: their parameters were not those most
    members of their step reported holding (`exclude_after` of them exclude the peer)."""
    return dedloc_states.state_strikes(r, job_id)


@admin_router.get("/commits", response_model=dict[int, CommitOut])
def commits(job_id: Id, r: RedisDep) -> dict[int, CommitOut]:
    """Step -> how it was committed (attempt, members, examples, result digest)."""
    return {step: CommitOut.model_validate(commit) for step, commit in dedloc_jobs.commits(r, job_id).items()}


@admin_router.get("/aborts", response_model=dict[str, AbortOut])
def aborts(job_id: Id, r: RedisDep) -> dict[str, AbortOut]:
    """ "step:attempt" -> the members of each aborted attempt and why it was aborted."""
    return {attempt: AbortOut.model_validate(abort) for attempt, abort in dedloc_jobs.aborts(r, job_id).items()}
