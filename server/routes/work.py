from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool

from assimilator.celery_app import enqueue_merge
from assimilator.epochs import close_epoch_if_complete
from crowdtrain.schemas import ClientError, HeartbeatReply, ResultAccepted, ResultMetrics, WorkReply, WorkRequest
from server import dispatch, results, telemetry
from server.deps import DbDep, HostDep, RedisDep, SettingsDep, StorageDep
from server.results import ResultProblem
from server.states import AssignmentStatus

router = APIRouter(prefix="/v1", tags=["work"])


def _problem(exc: ResultProblem) -> HTTPException:
    return HTTPException(exc.status, exc.message)


@router.post("/work", response_model=WorkReply)
def request_work(req: WorkRequest, host_id: HostDep, db: DbDep, storage: StorageDep, r: RedisDep,
                 settings: SettingsDep) -> WorkReply:
    """Ask for up to `free_slots` assignments."""
    assignments = dispatch.request_work(db, storage, host_id, req.free_slots, req.cached_shards, req.resources,
                                        settings.presign_seconds)
    cached = set(req.cached_shards)
    hits = [a.shard.size for a in assignments if a.shard.sha256 in cached]
    telemetry.count(r, "work_requests", dispatches=len(assignments), dispatches_cached_shard=len(hits),
                    shard_bytes_saved=sum(hits),
                    shard_bytes_sent=sum(a.shard.size for a in assignments) - sum(hits))
    return WorkReply(assignments=assignments, retry_after=settings.work_retry_after,
                     heartbeat_interval=settings.heartbeat_interval)


@router.post("/assignments/{assignment_id}/heartbeat", response_model=HeartbeatReply)
def heartbeat(assignment_id: int, host_id: HostDep, db: DbDep) -> HeartbeatReply:
    try:
        keep_going, reason = results.heartbeat(db, host_id, assignment_id)
    except ResultProblem as exc:
        raise _problem(exc) from None
    return HeartbeatReply(keep_going=keep_going, reason=reason)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"upload of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"upload exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@router.put("/assignments/{assignment_id}/result", response_model=ResultAccepted, status_code=status.HTTP_202_ACCEPTED)
async def upload_result(assignment_id: int, request: Request, metrics: Annotated[ResultMetrics, Depends()],
                        host_id: HostDep, db: DbDep, storage: StorageDep, r: RedisDep,
                        settings: SettingsDep) -> ResultAccepted:
    """Upload the trained parameters (safetensors body); metrics ride in the query string."""
    body = await _read_body(request, settings.upload_max_bytes)
    try:
        status_ = await run_in_threadpool(results.upload_result, db, storage, host_id, assignment_id, body,
                                          metrics, enqueue_merge)
    except ResultProblem as exc:
        raise _problem(exc) from None
    telemetry.count(r, "uploads")
    return ResultAccepted(assignment_id=assignment_id, status=status_)


@router.post("/assignments/{assignment_id}/abandon", response_model=ResultAccepted)
def abandon(assignment_id: int, host_id: HostDep, db: DbDep) -> ResultAccepted:
    """Give the assignment back now (shutdown, preemption) so it is re-dispatched without waiting."""
    try:
        results.give_up(db, host_id, assignment_id, AssignmentStatus.abandoned, "abandoned by the host")
    except ResultProblem as exc:
        raise _problem(exc) from None
    return ResultAccepted(assignment_id=assignment_id, status=AssignmentStatus.abandoned.value)


@router.post("/assignments/{assignment_id}/error", response_model=ResultAccepted)
def report_error(assignment_id: int, err: ClientError, host_id: HostDep, db: DbDep, storage: StorageDep,
                 r: RedisDep) -> ResultAccepted:
    """Report that the assignment failed on this host; it counts toward the workunit's error limit."""
    try:
        failed = results.give_up(db, host_id, assignment_id, AssignmentStatus.client_error, err.message)
    except ResultProblem as exc:
        raise _problem(exc) from None
    if failed is not None:
        close_epoch_if_complete(db, storage, r, *failed)
    return ResultAccepted(assignment_id=assignment_id, status=AssignmentStatus.client_error.value)
