"""The project key as the scheduler knows it: public keys only, the newest signing the work now, each
later one reached from the one before by a rotation statement (crowdtrain.core.signing). The operator
sets the first key once; after that it changes only by a statement signed with the key in use, so an
admin token alone cannot put another key in its place. Jobs' signatures: crowdtrain.server.ledger.jobs."""

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import signing
from crowdtrain.core.refusals import NotFound, Refusal, RefusalKind
from crowdtrain.core.schemas import KeyRotation, ProjectKeyOut
from crowdtrain.core.schemas_jobs import JobRecipe
from crowdtrain.core.states import JobStatus
from crowdtrain.server.ledger import jobs as ledger_jobs
from crowdtrain.server.ledger.models import Job, ProjectKey

log = logging.getLogger(__name__)


class ProjectKeyRefused(Refusal):
    """A key or rotation the project cannot take (conflict), or a statement that does not verify (unacceptable)."""


def _keys(s: Session) -> list[ProjectKey]:
    return list(s.scalars(select(ProjectKey).order_by(ProjectKey.id)))


def _rotations(keys: list[ProjectKey]) -> list[KeyRotation]:
    return [
        KeyRotation(old_public_key=old.public_key, new_public_key=new.public_key, signature=new.rotation_signature)
        for old, new in zip(keys, keys[1:], strict=False)
        if new.rotation_signature is not None
    ]


def current_key(db: sessionmaker[Session]) -> str | None:
    """The public key that signs the project's work now; None while the project signs nothing."""
    with db.begin() as s:
        return s.scalar(select(ProjectKey.public_key).order_by(ProjectKey.id.desc()).limit(1))


def rotations(db: sessionmaker[Session]) -> list[KeyRotation]:
    """Every rotation of the project key, oldest first."""
    with db.begin() as s:
        return _rotations(_keys(s))


def project_key(db: sessionmaker[Session]) -> ProjectKeyOut:
    with db.begin() as s:
        keys = _keys(s)
        current = keys[-1].public_key if keys else None
        return ProjectKeyOut(
            public_key=current, key_id=signing.key_id(current) if current else None, rotations=_rotations(keys)
        )


def set_key(db: sessionmaker[Session], public_key: str) -> ProjectKeyOut:
    """Set the project's first key; the same key again changes nothing, another one is a conflict
    (a key in use changes only by rotation). One transaction."""
    with db.begin() as s:
        keys = _keys(s)
        if keys and keys[-1].public_key != public_key:
            raise ProjectKeyRefused(
                f"the project key is already {signing.key_id(keys[-1].public_key)}: change it with a rotation "
                "statement signed by it (crowdtrain admin project-key rotate)"
            )
        if not keys:
            s.add(ProjectKey(public_key=public_key))
            log.info("project key set to %s: jobs from now on wait for their signature", signing.key_id(public_key))
    return project_key(db)


def rotate(db: sessionmaker[Session], rotation: KeyRotation) -> ProjectKeyOut:
    """Make `rotation.new_public_key` the project key, if the statement is signed by the key in use;
    ProjectKeyRefused with nothing changed otherwise. Jobs signed before keep their signatures until
    the operator signs them again (crowdtrain.server.ledger.jobs.sign_job). One transaction."""
    with db.begin() as s:
        keys = _keys(s)
        if not keys:
            raise ProjectKeyRefused(
                "the project has no key to rotate: set one first (crowdtrain admin project-key set)"
            )
        if rotation.old_public_key != keys[-1].public_key:
            raise ProjectKeyRefused(
                f"old_public_key: the project key in use is {signing.key_id(keys[-1].public_key)}, "
                f"not {signing.key_id(rotation.old_public_key)}"
            )
        if any(k.public_key == rotation.new_public_key for k in keys):
            raise ProjectKeyRefused("new_public_key: the project has used that key before; make a new one")
        if not signing.verify_rotation(rotation.old_public_key, rotation.new_public_key, rotation.signature):
            raise ProjectKeyRefused(
                "signature: it does not verify the rotation statement with the old key", RefusalKind.unacceptable
            )
        s.add(ProjectKey(public_key=rotation.new_public_key, rotation_signature=rotation.signature))
        log.info(
            "project key rotated from %s to %s",
            signing.key_id(rotation.old_public_key),
            signing.key_id(rotation.new_public_key),
        )
    return project_key(db)


def sign_job(db: sessionmaker[Session], job_id: int, signature: str) -> JobStatus:
    """Record the operator's signature of the job's recipe, checked with the project key in use
    (crowdtrain.server.ledger.jobs.sign_job); a conflict if the project has no key."""
    key = current_key(db)
    if key is None:
        raise ProjectKeyRefused("the project has no key (crowdtrain admin project-key set): its jobs run unsigned")
    status = ledger_jobs.sign_job(db, job_id, key, signature)
    log.info("job %s: recipe signed with the project key %s; %s", job_id, signing.key_id(key), status.value)
    return status


def job_recipe(db: sessionmaker[Session], job_id: int) -> JobRecipe:
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        if job.recipe is None:
            raise ProjectKeyRefused(f"job {job_id} has no recipe (it was submitted before signed work)")
        return JobRecipe(
            job_id=job.id,
            status=JobStatus(job.status),
            recipe=job.recipe,
            public_key=job.recipe_public_key,
            signature=job.recipe_signature,
        )
