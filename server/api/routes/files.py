"""Shards and snapshots served by the scheduler (when object storage cannot presign), to the hosts
that need them: see crowdtrain.server.services.access for who may read what."""

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse, Response

from crowdtrain.core import keys
from crowdtrain.core.schemas import Id
from crowdtrain.server.api.deps import DbDep, HostDep, RedisDep, StorageDep
from crowdtrain.server.services import access

router = APIRouter(prefix="/v1", tags=["files"])


def _serve(storage, key: str) -> Response:
    path = storage.local_path(key)
    if path is not None:
        return FileResponse(path, media_type="application/octet-stream")
    return Response(storage.get(key), media_type="application/octet-stream")


@router.get("/shards/{shard_id}", response_class=Response)
def get_shard(shard_id: Id, host_id: HostDep, db: DbDep, r: RedisDep, storage: StorageDep) -> Response:
    """A shard of training data, for a host whose running assignment (or DeDLOC collaboration) uses it."""
    key = access.readable_shard_key(db, r, host_id, shard_id)
    if key is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"shard {shard_id} does not exist or none of your assignments needs it"
        )
    return _serve(storage, key)


@router.get("/jobs/{job_id}/snapshots/{version}", response_class=Response)
def get_snapshot(job_id: Id, version: Id, host_id: HostDep, db: DbDep, storage: StorageDep) -> Response:
    """A published W_s snapshot, for a host whose running assignment of the job starts from it."""
    key = keys.snapshot_key(job_id, version)
    if not access.may_read_snapshot(db, host_id, job_id, version) or not storage.exists(key):
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"snapshot v{version} of job {job_id} does not exist or none of your assignments needs it",
        )
    return _serve(storage, key)
