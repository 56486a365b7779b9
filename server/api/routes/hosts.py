"""`/v1/hosts`: registration with a join token."""

from fastapi import APIRouter, Request, status

from crowdtrain.core.schemas import HostRegister, HostRegistered
from crowdtrain.core.storage import download_origin
from crowdtrain.server.api.deps import DbDep, FailureBudgetDep, SettingsDep, StorageDep
from crowdtrain.server.services.hosts import register_host
from crowdtrain.server.services.project_key import current_key
from crowdtrain.server.services.registration import RegistrationPolicy

router = APIRouter(prefix="/v1", tags=["hosts"])


@router.post("/hosts", response_model=HostRegistered, status_code=status.HTTP_201_CREATED)
def register(
    req: HostRegister, request: Request, db: DbDep, settings: SettingsDep, storage: StorageDep, _: FailureBudgetDep
) -> HostRegistered:
    """Register a client with a join token (one issued with `crowdtrain admin join-token create`, or the
    bootstrap token from the settings); answers the host token to use from now on, and the object
    store's origin if shards and snapshots are downloaded from it (the client pins it), and the
    project's public key if it signs its work (a client given none pins it: trust on first use).

    An invalid or revoked join token is refused (403) and spends the caller's failure budget. A join token, and
    the caller's network, register a limited number of hosts in any hour: more are refused (429, Retry-After).
    A join token issued to an account puts the host under that account, whatever account it names; a host of
    an account or a network that has a host in quarantine starts in the same quarantine."""
    address = request.client.host if request.client else ""
    registered = register_host(db, req, settings.join_token, address, RegistrationPolicy.from_settings(settings))
    origin = download_origin(storage)
    return registered.model_copy(
        update={"download_origins": [origin] if origin else [], "project_public_key": current_key(db)}
    )
