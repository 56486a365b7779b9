"""`/v1/mixtures`: expert-parallel training's registry. The operator creates a mixture (admin token);
expert hosts lease its experts and keep their checkpoints here, and trainers follow its routing
table and report their calls (host token)."""

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from crowdtrain.core.schemas import INT32_MAX, Id
from crowdtrain.core.schemas_experts import (
    CallReport,
    CallsRecorded,
    CheckpointStored,
    LeaseRequest,
    Leases,
    MixtureCreate,
    MixtureCreated,
    MixtureOut,
    RoutingTable,
)
from crowdtrain.server.api.boundary import UPLOAD_RESPONSES, octet_stream_body, upload_body
from crowdtrain.server.api.deps import AdminDep, DbDep, HostDep, NowDep, SettingsDep, StorageDep
from crowdtrain.server.services import experts

router = APIRouter(prefix="/v1/mixtures", tags=["experts"])
admin_router = APIRouter(prefix="/v1/mixtures", tags=["experts", "admin"], dependencies=[AdminDep])

ExpertId = Annotated[str, Path(max_length=40, pattern=r"^\d{1,4}(\.\d{1,4}){1,4}$", description="layer.coordinate...")]


@admin_router.post("", response_model=MixtureCreated, status_code=status.HTTP_201_CREATED)
def create(req: MixtureCreate, db: DbDep) -> MixtureCreated:
    """A new mixture: every expert of its layout, leased to expert hosts as they ask."""
    return experts.create_mixture(db, req)


@admin_router.get("/{mixture_id}", response_model=MixtureOut)
def mixture(mixture_id: Id, db: DbDep) -> MixtureOut:
    """The mixture and each expert's host, lease and last checkpoint."""
    return experts.mixture_status(db, mixture_id)


@router.post("/{mixture_id}/leases", response_model=Leases)
def lease(mixture_id: Id, req: LeaseRequest, host_id: HostDep, db: DbDep, now: NowDep) -> Leases:
    """An expert host's heartbeat: the experts it serves from now on. Its leases are renewed, and while
    it has room and the scheduler reaches its URL (a connect-back probe of `/v1/health`), it is leased
    free experts. Unreachable with no expert yet: 422."""
    return experts.lease(db, host_id, mixture_id, req, now)


@router.post("/{mixture_id}/calls", response_model=CallsRecorded)
def calls(mixture_id: Id, report: CallReport, host_id: HostDep, db: DbDep, now: NowDep) -> CallsRecorded:
    """A trainer's report of its calls to the mixture's experts since its last: per expert and host, the
    calls answered (and their rows), failed, dropped late and refused. The experts' current hosts are
    credited for what they answered and charged for refused answers (NaN, wrong shapes), which
    quarantine a host that keeps sending them; entries about an expert's former host are ignored."""
    return experts.record_calls(db, host_id, mixture_id, report, now)


@router.get("/{mixture_id}/routing", response_model=RoutingTable)
def routing(
    mixture_id: Id,
    db: DbDep,
    _: HostDep,
    since: Annotated[int, Query(ge=0, le=INT32_MAX, description="the version the caller holds")] = 0,
) -> RoutingTable:
    """Where each expert is served: the experts whose host changed after version `since`."""
    return experts.routing(db, mixture_id, since)


@router.put(
    "/{mixture_id}/experts/{uid}/checkpoint",
    response_model=CheckpointStored,
    responses=UPLOAD_RESPONSES,
    openapi_extra=octet_stream_body("The expert's weights and optimizer state (safetensors)"),
)
async def put_checkpoint(
    mixture_id: Id,
    uid: ExpertId,
    step: Annotated[int, Query(ge=1, le=INT32_MAX, description="the expert's steps so far")],
    request: Request,
    host_id: HostDep,
    db: DbDep,
    storage: StorageDep,
    settings: SettingsDep,
    now: NowDep,
) -> CheckpointStored:
    """The expert's checkpoint, from the host that leases it; a step no newer than the last is 409."""
    async with upload_body(request, settings.upload_max_bytes) as body:
        return await run_in_threadpool(
            experts.store_checkpoint, db, storage, host_id, mixture_id, uid, step, bytes(body), now
        )


@router.get("/{mixture_id}/experts/{uid}/checkpoint", response_class=Response)
def get_checkpoint(
    mixture_id: Id,
    uid: ExpertId,
    host_id: HostDep,
    db: DbDep,
    storage: StorageDep,
    now: NowDep,
    of: Annotated[
        Literal["newest", "peer"],
        Query(description="newest: of any of the expert's replicas (to restore); peer: of its other replicas"),
    ] = "newest",
) -> Response:
    """A checkpoint of the expert, for the host that leases one of its replicas."""
    return Response(
        experts.checkpoint(db, storage, host_id, mixture_id, uid, now, peer=of == "peer"),
        media_type="application/octet-stream",
    )
