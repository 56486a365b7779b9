"""`/v1/admin`: join tokens and hosts, for the operator (admin token)."""

from fastapi import APIRouter, status

from crowdtrain.core.schemas import (
    HostPublic,
    Id,
    JoinTokenCreate,
    JoinTokenCreated,
    JoinTokenPublic,
    KeyRotation,
    ProjectKeyOut,
    ProjectKeySet,
)
from crowdtrain.server.api.deps import AdminDep, DbDep, EvaluatorDep, RedisDep, StorageDep
from crowdtrain.server.services import hosts, project_key

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[AdminDep])


@router.post("/join-tokens", response_model=JoinTokenCreated, status_code=status.HTTP_201_CREATED)
def create_join_token(req: JoinTokenCreate, db: DbDep) -> JoinTokenCreated:
    """Issue a join token for volunteers or a fleet; the answer is the only time it is shown. A token issued to
    an `account` puts every host registered with it under that account, whatever account the host names; one
    with `registrations_per_hour` registers at most that many hosts in any hour (default: the scheduler's)."""
    return hosts.create_join_token(db, req)


@router.get("/join-tokens", response_model=list[JoinTokenPublic])
def list_join_tokens(db: DbDep) -> list[JoinTokenPublic]:
    return hosts.list_join_tokens(db)


@router.post("/join-tokens/{token_id}/revoke", response_model=JoinTokenPublic)
def revoke_join_token(token_id: Id, db: DbDep) -> JoinTokenPublic:
    """No new host can register with the token (404 if there is none); hosts already registered keep working."""
    return hosts.revoke_join_token(db, token_id)


@router.get("/hosts", response_model=list[HostPublic])
def list_hosts(db: DbDep) -> list[HostPublic]:
    return hosts.list_hosts(db)


@router.post("/hosts/{host_id}/revoke", response_model=HostPublic)
def revoke_host(host_id: Id, db: DbDep, storage: StorageDep, r: RedisDep, evaluator: EvaluatorDep) -> HostPublic:
    """Refuse a host from now on (404 if there is none); its running assignments are dispatched again at once."""
    return hosts.revoke_host(db, storage, r, evaluator, host_id)


@router.get("/project-key", response_model=ProjectKeyOut)
def get_project_key(db: DbDep) -> ProjectKeyOut:
    """The public key that signs the project's work now, and every rotation that led to it."""
    return project_key.project_key(db)


@router.post("/project-key", response_model=ProjectKeyOut)
def set_project_key(req: ProjectKeySet, db: DbDep) -> ProjectKeyOut:
    """Set the project's first public key: jobs submitted from now on wait for the operator's signature.
    The same key again changes nothing; another is 409 (a key in use changes only by rotation)."""
    return project_key.set_key(db, req.public_key)


@router.post("/project-key/rotations", response_model=ProjectKeyOut)
def rotate_project_key(req: KeyRotation, db: DbDep) -> ProjectKeyOut:
    """Rotate the project key with a statement signed by the key in use (422 if it does not verify,
    409 if it names another old key or a key used before); clients follow it to the new key."""
    return project_key.rotate(db, req)


@router.post("/hosts/{host_id}/release", response_model=HostPublic)
def release_host(host_id: Id, db: DbDep) -> HostPublic:
    """End a host's quarantine now (404 if there is no such host): it gets work again, on probation."""
    return hosts.release_host(db, host_id)
