import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from crowdtrain.core import keys, merge_stages
from crowdtrain.core.schemas import (
    AssignmentOut,
    ClientError,
    HeartbeatReply,
    Id,
    ResultAccepted,
    ResultMetrics,
    SnapshotBound,
    WorkReply,
    WorkRequest,
)
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.api.boundary import (
    UPLOAD_RESPONSES,
    BodyTooLarge,
    json_body,
    octet_stream_body,
    parse_json_body,
    path_id,
    path_parameter,
    upload_body,
)
from crowdtrain.server.api.deps import (
    DbDep,
    EvaluatorDep,
    HostCall,
    HostDep,
    MergeQueueDep,
    RedisDep,
    SettingsDep,
    StorageDep,
    serve_host_call,
)
from crowdtrain.server.api.lean import HOST_TOKEN_SECURITY, LeanRoute
from crowdtrain.server.services import backpressure, dispatch, held_hosts, project_key, results, telemetry

router = APIRouter(prefix="/v1", tags=["work"])


async def request_work(request: Request) -> Response:
    """Ask for up to `free_slots` assignments (a WorkRequest body).

    A LeanRoute: the route reads its token and body itself. The body is parsed after the token is
    authenticated, so that a wrong token is answered 401 whatever the body."""
    body = await request.body()
    # Serialised by the service's caller, once: the reply is built from validated parts, and FastAPI
    # would validate it again.
    return await serve_host_call(request, lambda call: _serve_work(body, call))


router.add_api_route(
    "/work",
    request_work,
    methods=["POST"],
    response_model=WorkReply,
    openapi_extra=json_body(WorkRequest) | HOST_TOKEN_SECURITY,
    route_class_override=LeanRoute,
)


def _serve_work(body: bytes, call: HostCall) -> bytes:
    """One thread-pool hop for the whole request: authentication and dispatch in one transaction
    (crowdtrain.server.services.dispatch.serve_work), then, before it commits, the telemetry counters in
    one Redis round trip; the answer's bytes."""

    def admit(req: WorkRequest, given: list[AssignmentOut]) -> None:
        call.budget.admit(keys.METRIC_COUNTERS, telemetry.work_request_events(req.cached_shards, given))

    _, served = dispatch.serve_work(
        call.db,
        call.storage,
        call.token,
        lambda: parse_json_body(WorkRequest, body),
        call.settings.presign_seconds,
        admit,
    )
    longest = call.settings.work_retry_after
    assignments = served.given
    held = served.held_seconds
    if held is not None and served.host_id is not None:
        waiting = held_hosts.note_waiting(call.r, served.host_id, time.time(), longest)
        held = backpressure.held_wait(held, served.held_rate, waiting)
    return (
        WorkReply(
            assignments=assignments,
            retry_after=backpressure.retry_after(held, longest),
            heartbeat_interval=results.heartbeat_interval(
                call.settings.heartbeat_interval, assignments, datetime.now(UTC)
            ),
            key_rotations=project_key.rotations(call.db) if any(a.signed for a in assignments) else [],
        )
        .model_dump_json()
        .encode()
    )


async def heartbeat(request: Request) -> Response:
    """The host still works on the assignment: its lease is extended (HeartbeatReply says whether
    the work is still wanted). A LeanRoute, as `request_work` is: a client sends one every
    `heartbeat_interval` for each assignment it holds, so heartbeats are the scheduler's most
    frequent call once workunits are long (docs/operator/capacity.md). The path's id is read after
    the token is authenticated, in the same transaction."""
    raw_id = request.path_params["assignment_id"]
    return await serve_host_call(request, lambda call: _heartbeat(call, lambda: path_id("assignment_id", raw_id)))


router.add_api_route(
    "/assignments/{assignment_id}/heartbeat",
    heartbeat,
    methods=["POST"],
    response_model=HeartbeatReply,
    openapi_extra=path_parameter("assignment_id", Id) | HOST_TOKEN_SECURITY,
    route_class_override=LeanRoute,
)


def _heartbeat(call: HostCall, assignment_id: Callable[[], int]) -> bytes:
    keep_going, reason, deadline = results.heartbeat_by_token(call.db, call.token, assignment_id)
    return HeartbeatReply(keep_going=keep_going, reason=reason, deadline=deadline).model_dump_json().encode()


@router.post("/assignments/{assignment_id}/start", response_model=SnapshotBound)
def start(assignment_id: Id, host_id: HostDep, db: DbDep, storage: StorageDep, settings: SettingsDep) -> SnapshotBound:
    """A compute slot starts the assignment: the snapshot it trains from (the newest, when the job binds
    snapshots at start; see scheduling.snapshot_binding). Ask again after a lost answer: the last answer
    is what the scheduler recorded."""
    return results.bind_snapshot(db, storage, host_id, assignment_id, settings.presign_seconds)


@router.put(
    "/assignments/{assignment_id}/result",
    response_model=ResultAccepted,
    status_code=status.HTTP_202_ACCEPTED,
    responses=UPLOAD_RESPONSES,
    openapi_extra=octet_stream_body(
        "The result (safetensors): the trained parameters, or their update "
        "encoded as the job's assimilation.upload says"
    ),
)
async def upload_result(
    assignment_id: Id,
    request: Request,
    metrics: Annotated[ResultMetrics, Query()],
    host_id: HostDep,
    db: DbDep,
    storage: StorageDep,
    r: RedisDep,
    settings: SettingsDep,
    evaluator: EvaluatorDep,
    merge_queue: MergeQueueDep,
) -> ResultAccepted:
    """Upload the result (safetensors body: W_c, or Δ as the job's assimilation.upload says); metrics
    ride in the query string.

    The assignment is checked before the body is read, and the body before any transaction, once,
    while it is written to storage (results.accept_result, one thread-pool hop): the check's
    digest of W_c is stored beside the body for the parameter server. A body refused for
    its content or its size ends the assignment `rejected`, so its workunit is dispatched again at once.
    """
    target = await run_in_threadpool(results.upload_target, db, host_id, assignment_id)
    try:
        async with upload_body(request, settings.upload_max_bytes) as body:
            stamps = merge_stages.received()
            status_ = await run_in_threadpool(
                results.accept_result,
                db,
                storage,
                r,
                host_id,
                assignment_id,
                target,
                body,
                metrics,
                merge_queue,
                stamps,
                evaluator,
            )
            size = len(body)
    except BodyTooLarge as exc:
        # A body refused for its size ends the assignment (accept_result ends it for its content);
        # the refusal is still answered.
        await run_in_threadpool(
            results.refuse_result, db, storage, r, host_id, assignment_id, str(exc.detail), evaluator
        )
        raise
    telemetry.count(r, "uploads", upload_bytes=size)
    return ResultAccepted(assignment_id=assignment_id, status=status_)


@router.post("/assignments/{assignment_id}/abandon", response_model=ResultAccepted)
def abandon(
    assignment_id: Id, host_id: HostDep, db: DbDep, storage: StorageDep, r: RedisDep, evaluator: EvaluatorDep
) -> ResultAccepted:
    """Give the assignment back now (shutdown, preemption) so it is re-dispatched without waiting."""
    results.give_up(
        db, storage, r, host_id, assignment_id, AssignmentStatus.abandoned, "abandoned by the host", evaluator
    )
    return ResultAccepted(assignment_id=assignment_id, status=AssignmentStatus.abandoned)


@router.post("/assignments/{assignment_id}/error", response_model=ResultAccepted)
def report_error(
    assignment_id: Id,
    err: ClientError,
    host_id: HostDep,
    db: DbDep,
    storage: StorageDep,
    r: RedisDep,
    evaluator: EvaluatorDep,
) -> ResultAccepted:
    """Report that the assignment failed on this host; it counts toward the workunit's error limit."""
    results.give_up(db, storage, r, host_id, assignment_id, AssignmentStatus.client_error, err.message, evaluator)
    return ResultAccepted(assignment_id=assignment_id, status=AssignmentStatus.client_error)
