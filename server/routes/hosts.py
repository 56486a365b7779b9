from fastapi import APIRouter, HTTPException, status

from crowdtrain.schemas import HostRegister, HostRegistered
from server.deps import DbDep, SettingsDep
from server.hosts import NotAuthorized, register_host

router = APIRouter(prefix="/v1", tags=["hosts"])


@router.post("/hosts", response_model=HostRegistered, status_code=status.HTTP_201_CREATED)
def register(req: HostRegister, db: DbDep, settings: SettingsDep) -> HostRegistered:
    """Register a client with a join token (one issued with `crowdtrain admin join-token create`, or the
    bootstrap token from the settings); answers the host token to use from now on."""
    try:
        return register_host(db, req, settings.join_token)
    except NotAuthorized as exc:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from None
