"""`/v1/dedloc`: the rendezvous of the synchronous DeDLOC mode (peers use their host token)."""

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from crowdtrain.core.schemas import Finite, Id
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
from crowdtrain.server.api.boundary import UPLOAD_RESPONSES, octet_stream_body, upload_body
from crowdtrain.server.api.deps import AdminDep, DbDep, HostDep, RedisDep, SettingsDep, StorageDep
from crowdtrain.server.services import dedloc_jobs, dedloc_rounds

router = APIRouter(prefix="/v1/dedloc/jobs/{job_id}", tags=["dedloc"])
admin_router = APIRouter(prefix="/v1/dedloc/jobs/{job_id}", tags=["dedloc", "admin"], dependencies=[AdminDep])


@router.post("/join", response_model=PeerJoined)
def join(job_id: Id, req: PeerJoin, host_id: HostDep, db: DbDep, r: RedisDep) -> PeerJoined:
    """Join the collaboration; the answer names the recipe, the shards and the step to sync to."""
    return dedloc_jobs.join(db, r, job_id, host_id, req.relayed)


@router.post("/refusal", response_model=ReplyOk)
def refuse(job_id: Id, req: PeerRefusal, host_id: HostDep, r: RedisDep) -> ReplyOk:
    """The peer will not train this job (its recipe is unsigned, or not signed by the key the peer
    trusts): it leaves the collaboration, and the job's problems show why. 403 for a peer that has not
    joined (or is another host's)."""
    dedloc_jobs.refuse(r, job_id, host_id, req)
    return ReplyOk(status=Outcome.recorded)


@router.post("/progress", response_model=ProgressReply)
def progress(job_id: Id, req: Progress, host_id: HostDep, db: DbDep, r: RedisDep) -> ProgressReply:
    """Report the examples accumulated for the current step; the answer says what to do next."""
    return dedloc_rounds.progress(db, r, job_id, host_id, req)


@router.post("/rounds/{step}/{attempt}/report", response_model=ReplyOk)
def report(job_id: Id, step: Id, attempt: Id, req: RoundReport, host_id: HostDep, db: DbDep, r: RedisDep) -> ReplyOk:
    """A member's outcome of its reduction; a failure aborts the attempt for every member."""
    return ReplyOk(
        status=dedloc_rounds.report(
            db, r, job_id, host_id, step, attempt, req.peer_id, req.ok, req.result_digest, req.message
        )
    )


@router.post("/rounds/{step}/{attempt}/store/{op}", response_model=StoreReply)
def store(job_id: Id, step: Id, attempt: Id, op: str, req: StoreOp, host_id: HostDep, r: RedisDep) -> StoreReply:
    """The torch.distributed Store of the caller's all-reduce group (a prefix per job, step, attempt, group)."""
    if op not in StoreOpName.__members__:
        known = ", ".join(StoreOpName)
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown store operation {op!r}; known: {known}")
    return dedloc_rounds.store_op(r, job_id, host_id, step, attempt, op, req)


@router.put(
    "/rounds/{step}/{attempt}/parts/{part}",
    response_model=ReplyOk,
    responses=UPLOAD_RESPONSES,
    openapi_extra=octet_stream_body("One float32 tensor 'g' (safetensors)"),
)
async def put_part(
    job_id: Id,
    step: Id,
    attempt: Id,
    part: str,
    peer_id: str,
    request: Request,
    host_id: HostDep,
    r: RedisDep,
    settings: SettingsDep,
) -> ReplyOk:
    """A group's sum or a relayed member's weighted gradient (safetensors, one float32 tensor 'g')."""
    async with upload_body(request, settings.upload_max_bytes) as body:
        return ReplyOk(
            status=await run_in_threadpool(
                dedloc_rounds.put_part, r, job_id, host_id, peer_id, step, attempt, part, body
            )
        )


@router.get(
    "/rounds/{step}/{attempt}/total",
    response_class=Response,
    responses={204: {"description": "Parts of the round are still missing: ask again"}},
)
def get_total(
    job_id: Id, step: Id, attempt: Id, peer_id: str, host_id: HostDep, r: RedisDep, wait: Finite = 2.0
) -> Response:
    """The sum of every part of the round: 200 with safetensors, or 204 while parts are missing."""
    blob = dedloc_rounds.get_total(r, job_id, host_id, peer_id, step, attempt, min(max(wait, 0.0), 5.0))
    if blob is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return Response(blob, media_type="application/octet-stream")


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
) -> ReplyOk:
    """Parameters and optimizer state at the start of `step` (safetensors); evaluated and recorded."""
    async with upload_body(request, settings.upload_max_bytes) as body:
        return ReplyOk(
            status=await run_in_threadpool(dedloc_jobs.put_state, db, r, storage, job_id, host_id, peer_id, step, body)
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


@admin_router.get("/commits", response_model=dict[int, CommitOut])
def commits(job_id: Id, r: RedisDep) -> dict[int, CommitOut]:
    """Step -> how it was committed (attempt, members, examples, result digest)."""
    return {step: CommitOut.model_validate(commit) for step, commit in dedloc_jobs.commits(r, job_id).items()}


@admin_router.get("/aborts", response_model=dict[str, AbortOut])
def aborts(job_id: Id, r: RedisDep) -> dict[str, AbortOut]:
    """ "step:attempt" -> the members of each aborted attempt and why it was aborted."""
    return {attempt: AbortOut.model_validate(abort) for attempt, abort in dedloc_jobs.aborts(r, job_id).items()}
