from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse, Response
from sqlalchemy import select

from server.deps import DbDep, HostDep, StorageDep
from server.models import Job, Shard
from workgen.generator import snapshot_key

router = APIRouter(prefix="/v1", tags=["files"])


def _serve(storage, key: str) -> Response:
    path = storage.local_path(key)
    if path is not None:
        return FileResponse(path, media_type="application/octet-stream")
    return Response(storage.get(key), media_type="application/octet-stream")


@router.get("/shards/{shard_id}", response_class=Response)
def get_shard(shard_id: int, _host: HostDep, db: DbDep, storage: StorageDep) -> Response:
    with db.begin() as s:
        key = s.scalar(select(Shard.key).where(Shard.id == shard_id))
    if key is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"shard {shard_id} does not exist")
    return _serve(storage, key)


@router.get("/jobs/{job_id}/snapshots/{version}", response_class=Response)
def get_snapshot(job_id: int, version: int, _host: HostDep, db: DbDep, storage: StorageDep) -> Response:
    with db.begin() as s:
        exists = s.scalar(select(Job.id).where(Job.id == job_id)) is not None
    key = snapshot_key(job_id, version)
    if not exists or not storage.exists(key):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no snapshot v{version}")
    return _serve(storage, key)
