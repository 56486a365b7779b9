"""`/v1/datasets`: datasets the operator uploads from their own machine (admin token), stored in
object storage under the sha256 of their bytes (crowdtrain.core.keys.dataset_key).

Idempotent by content: bytes the scheduler already has are not sent again (GET says so, and a PUT
of them is answered at once). A body is streamed to a scratch file, and stored only once it is
whole and its hash is the one named: a broken or refused upload leaves nothing a job could use.
"""

import tempfile
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from crowdtrain.core import keys
from crowdtrain.core.schemas import Sha256
from crowdtrain.core.schemas_jobs import DatasetStored
from crowdtrain.server.api.boundary import octet_stream_body, receive_to_file
from crowdtrain.server.api.deps import AdminDep, SettingsDep, StorageDep

router = APIRouter(prefix="/v1/datasets", tags=["admin"], dependencies=[AdminDep])


@router.get("/{sha256}", response_model=DatasetStored)
def stored_dataset(sha256: Sha256, storage: StorageDep) -> DatasetStored:
    """Whether the scheduler has a dataset with these bytes (404 if not)."""
    if not storage.exists(keys.dataset_key(sha256)):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no dataset with sha256 {sha256} was uploaded")
    return DatasetStored(sha256=sha256, created=False)


@router.put(
    "/{sha256}",
    response_model=DatasetStored,
    status_code=status.HTTP_201_CREATED,
    responses={200: {"model": DatasetStored, "description": "The scheduler already had these bytes"}},
    openapi_extra=octet_stream_body(
        "The dataset's bytes (a file, or an uncompressed tar archive of a folder), whose sha256 the path names"
    ),
)
async def upload_dataset(
    sha256: Sha256, request: Request, response: Response, storage: StorageDep, settings: SettingsDep
) -> DatasetStored:
    """Store a dataset under the sha256 of its bytes: 201 once stored, 200 if it already was; 413 for a
    body over `dataset_max_bytes`, 400 for bytes whose hash is not the one named (nothing stored)."""
    key = keys.dataset_key(sha256)
    if await run_in_threadpool(storage.exists, key):
        response.status_code = status.HTTP_200_OK
        return DatasetStored(sha256=sha256, created=False)
    scratch = settings.var_dir / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=scratch, prefix="upload-") as part:
        digest, size = await receive_to_file(request, part, settings.dataset_max_bytes)
        if size == 0:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, "the dataset is empty; nothing was stored")
        if digest != sha256:
            raise HTTPException(
                status.HTTP_400_BAD_REQUEST,
                f"the body's sha256 is {digest}, not {sha256} as named: nothing was stored (an interrupted "
                "upload? send it again)",
            )
        await run_in_threadpool(storage.put_file, key, Path(part.name))
    return DatasetStored(sha256=sha256, created=True)
