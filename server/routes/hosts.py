from fastapi import APIRouter, HTTPException, status

from crowdtrain.schemas import HostRegister, HostRegistered
from crowdtrain.storage import download_origin
from server.deps import DbDep, FailureBudgetDep, SettingsDep, StorageDep
from server.hosts import NotAuthorized, register_host

router = APIRouter(prefix="/v1", tags=["hosts"])


@router.post("/hosts", response_model=HostRegistered, status_code=status.HTTP_201_CREATED)
def register(req: HostRegister, db: DbDep, settings: SettingsDep, storage: StorageDep,
             budget: FailureBudgetDep) -> HostRegistered:
    """Register a client with a join token (one issued with `crowdtrain admin join-token create`, or the
    bootstrap token from the settings); answers the host token to use from now on, and the object
    store's origin if shards and snapshots are downloaded from it (the client pins it)."""
    try:
        registered = register_host(db, req, settings.join_token)
    except NotAuthorized as exc:
        budget.spend()
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from None
    origin = download_origin(storage)
    return registered.model_copy(update={"download_origins": [origin] if origin else []})
