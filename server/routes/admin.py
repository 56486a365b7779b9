from fastapi import APIRouter, HTTPException, status

from assimilator.epochs import close_epoch_if_complete
from crowdtrain.schemas import HostPublic, JoinTokenCreate, JoinTokenCreated, JoinTokenPublic
from server import hosts
from crowdtrain.schemas import Id
from server.deps import AdminDep, DbDep, RedisDep, StorageDep

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[AdminDep])


def _not_found(exc: LookupError) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, str(exc.args[0]))


@router.post("/join-tokens", response_model=JoinTokenCreated, status_code=status.HTTP_201_CREATED)
def create_join_token(req: JoinTokenCreate, db: DbDep) -> JoinTokenCreated:
    """Issue a join token for volunteers or a fleet; the answer is the only time it is shown."""
    return hosts.create_join_token(db, req.label)


@router.get("/join-tokens", response_model=list[JoinTokenPublic])
def list_join_tokens(db: DbDep) -> list[JoinTokenPublic]:
    return hosts.list_join_tokens(db)


@router.post("/join-tokens/{token_id}/revoke", response_model=JoinTokenPublic)
def revoke_join_token(token_id: Id, db: DbDep) -> JoinTokenPublic:
    try:
        return hosts.revoke_join_token(db, token_id)
    except LookupError as exc:
        raise _not_found(exc) from None


@router.get("/hosts", response_model=list[HostPublic])
def list_hosts(db: DbDep) -> list[HostPublic]:
    return hosts.list_hosts(db)


@router.post("/hosts/{host_id}/revoke", response_model=HostPublic)
def revoke_host(host_id: Id, db: DbDep, storage: StorageDep, r: RedisDep) -> HostPublic:
    """Refuse a host from now on; its running assignments are dispatched again at once."""
    try:
        host, failed = hosts.revoke_host(db, host_id)
    except LookupError as exc:
        raise _not_found(exc) from None
    for job_id, epoch in failed:
        close_epoch_if_complete(db, storage, r, job_id, epoch)
    return host
