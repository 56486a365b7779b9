"""`/v1/jobs`: submitting, watching and cancelling jobs, for the operator (admin token)."""

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from crowdtrain.core.jobspec import JobSpec
from crowdtrain.core.schemas import Id
from crowdtrain.core.schemas_jobs import (
    JobCancelled,
    JobCreated,
    JobProblems,
    JobRecipe,
    JobSignature,
    JobStatusOut,
    JobSummary,
)
from crowdtrain.core.states import JobStatus
from crowdtrain.server.api.deps import AdminDep, DbDep, RedisDep, SettingsDep, StorageDep
from crowdtrain.server.services import dedloc_jobs, diagnosis, jobs, project_key
from crowdtrain.workgen.generator import submit_job
from crowdtrain.workgen.image_decoding import ImageBounds

router = APIRouter(prefix="/v1/jobs", tags=["admin"], dependencies=[AdminDep])


@router.post("", response_model=JobCreated, status_code=status.HTTP_201_CREATED)
async def submit(spec: JobSpec, db: DbDep, storage: StorageDep, r: RedisDep, settings: SettingsDep) -> JobCreated:
    """Submit a job spec: shards are made and stored, W_s v0 initialised, epoch 1 released. The answer
    carries the job's recipe; when the project has a key the job stays pending, releasing no work,
    until `POST /v1/jobs/{id}/signature` brings the operator's signature of that recipe.

    422 names the field and the problem of a spec that could not train (a bad dataset, a model
    that cannot take it or whose upload would exceed the limit; an image folder too large or too slow to
    decode, which a child process does, not this one); nothing is stored then."""
    signed = await run_in_threadpool(project_key.current_key, db) is not None
    try:
        prepared = await run_in_threadpool(
            submit_job,
            db,
            storage,
            r,
            spec,
            settings.upload_max_bytes,
            settings.var_dir / "scratch",
            settings.dataset_max_bytes,
            signed,
            ImageBounds(
                settings.dataset_max_pixels, settings.dataset_decode_max_seconds, settings.dataset_decode_max_bytes
            ),
        )
    except ValueError as exc:  # the generator's word for a spec it cannot prepare
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    if spec.mode == "dedloc":
        await run_in_threadpool(dedloc_jobs.open_job, r, storage, prepared.job_id)
    return JobCreated(
        job_id=prepared.job_id,
        status=JobStatus.pending if signed else JobStatus.running,
        shards=prepared.shards,
        parameters=prepared.parameters,
        recipe=prepared.recipe,
        signature_required=signed,
    )


@router.post("/{job_id}/signature", response_model=JobRecipe)
def sign(job_id: Id, body: JobSignature, db: DbDep) -> JobRecipe:
    """The operator's signature of the job's recipe, checked with the project key: a job waiting for it
    starts; a running job's signature is replaced (after a key rotation). 422 if it does not verify,
    409 if the project has no key or the job has ended; nothing changes then. 404 for no such job."""
    project_key.sign_job(db, job_id, body.signature)
    return project_key.job_recipe(db, job_id)


@router.get("/{job_id}/recipe", response_model=JobRecipe)
def recipe_of(job_id: Id, db: DbDep) -> JobRecipe:
    """The job's recipe (what the project key signs) and its signature, if any. 404 for no such job."""
    return project_key.job_recipe(db, job_id)


@router.get("", response_model=list[JobSummary])
def list_all(db: DbDep) -> list[JobSummary]:
    """Every job, oldest first."""
    return jobs.list_jobs(db)


@router.get("/{job_id}", response_model=JobStatusOut)
def status_of(job_id: Id, db: DbDep, metrics: bool = False) -> JobStatusOut:
    """Job status with per-epoch figures; `?metrics=true` adds every validation point. 404 for no such job."""
    return jobs.job_status(db, job_id, with_metrics=metrics)


@router.get("/{job_id}/problems", response_model=JobProblems)
def problems_of(job_id: Id, db: DbDep, r: RedisDep, limit: Annotated[int, Query(ge=0, le=1000)] = 20) -> JobProblems:
    """Why a job is stuck or failed: its assignments that ended in a client error, a refused upload or
    a timeout, by reason and the `limit` latest in full, whether hosts can run it, and the DeDLOC peers
    that refused it. 404 for no such job."""
    return diagnosis.job_problems(db, job_id, limit, dedloc_jobs.refusals(r, job_id))


@router.post("/{job_id}/cancel", response_model=JobCancelled)
def cancel(job_id: Id, db: DbDep, r: RedisDep) -> JobCancelled:
    """Cancel a pending or running job (404 for no such job, 409 for a finished one)."""
    return JobCancelled(job_id=job_id, status=jobs.cancel_job(db, r, job_id))


@router.get("/{job_id}/model", response_class=Response)
def download_model(job_id: Id, db: DbDep, storage: StorageDep, r: RedisDep) -> Response:
    """The final model (safetensors) once the job has finished (409 before)."""
    key = jobs.final_model_key(db, storage, r, job_id)
    if key is None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} has no final model yet")
    return Response(
        storage.get(key),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="job-{job_id}.safetensors"'},
    )
