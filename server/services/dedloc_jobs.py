"""Service layer of the DeDLOC mode, the job's side: what a job's `/v1/dedloc` requests do to Redis,
storage and the database when the job opens, a peer joins, and the state of a committed step is
uploaded (evaluated, the stop rule applied) or read; and the admin read-outs. A round's requests are
in crowdtrain.server.services.dedloc_rounds, the round's phases themselves in
crowdtrain.server.services.dedloc; the routes only move data in and out."""

import json
import logging
import secrets

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import dedloc as math
from crowdtrain.core import keys
from crowdtrain.core.dedloc import StateVerdict
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.core.modelfile import model_metadata, with_metadata
from crowdtrain.core.refusals import Refusal, RefusalKind
from crowdtrain.core.schemas import SignedRecipe
from crowdtrain.core.schemas_dedloc import Outcome, PeerJoined, PeerRefusal, ShardRef
from crowdtrain.core.states import JobStatus
from crowdtrain.core.storage import Storage
from crowdtrain.core.tensors import (
    check_against_manifest,
    decode,
    decode_shard,
    encode,
    sha256,
)
from crowdtrain.server.ledger import jobs as ledger_jobs
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.ledger.models import Job, Shard
from crowdtrain.server.services import access, dedloc, dedloc_document, dedloc_peers, dedloc_states, project_key
from crowdtrain.server.services.clock import now_or_wall
from crowdtrain.server.services.dedloc_document import Round
from crowdtrain.server.services.dedloc_peers import NotAMember

log = logging.getLogger(__name__)


class DedlocProblem(Refusal):
    """A DeDLOC request that cannot be honoured, and why (`kind`)."""

    def __init__(self, kind: RefusalKind, message: str):
        super().__init__(message, kind)


class JobView:
    """What the DeDLOC services need of a job row, read once per request."""

    def __init__(self, job: Job):
        if job.mode != "dedloc":
            raise DedlocProblem(RefusalKind.conflict, f"job {job.id} runs in mode {job.mode!r}, not 'dedloc'")
        self.id = job.id
        self.name = job.name
        self.job_spec = job.spec
        self.spec = DedlocSpec.model_validate(job.spec["dedloc"])
        self.max_steps = int(job.spec["stop"]["max_steps"])
        self.target_accuracy = float(job.spec["stop"]["target_accuracy"])
        self.running = job.status == JobStatus.running.value
        self.model_config = job.model_config_
        self.manifest = job.param_manifest
        self.seed = job.spec["seed"]
        self.validation_key = job.validation_key
        self.signed = (
            SignedRecipe(recipe=job.recipe, public_key=job.recipe_public_key, signature=job.recipe_signature)
            if job.recipe is not None and job.recipe_public_key is not None and job.recipe_signature is not None
            else None
        )


def job_view(db: sessionmaker[Session], job_id: int) -> JobView:
    with db.begin() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise DedlocProblem(RefusalKind.not_found, f"job {job_id} does not exist")
        return JobView(job)


def open_job(r: redis.Redis, storage: Storage, job_id: int) -> None:
    """Called once the job is submitted: step 0's state is the initial parameters (no optimizer state)."""
    storage.put(keys.dedloc_state_key(job_id, 0), storage.get(keys.snapshot_key(job_id, 0)))
    dedloc_document.open_job(r, job_id)


def join(
    db: sessionmaker[Session], r: redis.Redis, job_id: int, host_id: int, relayed: bool, now: float | None = None
) -> PeerJoined:
    """A new peer of `host_id` joins at `now` (the clock's if None)."""
    now = now_or_wall(now)
    view = job_view(db, job_id)
    if not view.running:
        raise DedlocProblem(RefusalKind.conflict, f"job {job_id} is not running")
    peer_id = f"h{host_id}-{secrets.token_hex(4)}"
    rnd = dedloc_document.load(r, job_id)
    if rnd is None:
        raise DedlocProblem(RefusalKind.conflict, f"job {job_id} is still being prepared; join again in a moment")
    dedloc_peers.join(r, job_id, peer_id, host_id, relayed, now)
    shards = []
    with db.begin() as s:
        for x in s.scalars(select(Shard).where(Shard.job_id == job_id, Shard.epoch == 0).order_by(Shard.index)):
            assert x.sha256 is not None  # epoch 0's shards are written at submission
            shards.append(ShardRef(id=x.id, index=x.index, sha256=x.sha256, size=x.size, examples=x.examples))
    log.info(
        "job %s: peer %s joined (host %s%s) at step %d",
        job_id,
        peer_id,
        host_id,
        ", relayed" if relayed else "",
        rnd.step,
    )
    recipe = {
        "model": view.model_config,
        # As recorded at submission, which the signed recipe holds: a dump of DedlocSpec would add the
        # fields of later versions and no longer match a job signed before them.
        "dedloc": view.job_spec["dedloc"],
        "seed": view.seed,
        "max_steps": view.max_steps,
    }
    return PeerJoined(
        peer_id=peer_id,
        job_id=job_id,
        recipe=recipe,
        shards=shards,
        step=rnd.step,
        state_step=rnd.state_step,
        signed=view.signed,
        key_rotations=project_key.rotations(db) if view.signed is not None else [],
    )


def refuse(r: redis.Redis, job_id: int, host_id: int, refusal: PeerRefusal, now: float | None = None) -> None:
    """A peer of `host_id` will not train the job (its recipe is unsigned, or signed by a key the peer
    does not trust): it leaves the collaboration at `now` (the clock's if None), and its reason is
    kept for the operator (the job's problems). Saying it again changes nothing but the time."""
    now = now_or_wall(now)
    try:
        dedloc_peers.touch(r, job_id, refusal.peer_id, host_id, now)
    except NotAMember as exc:
        raise DedlocProblem(RefusalKind.forbidden, str(exc)) from None
    r.hdel(keys.dedloc_peers(job_id), refusal.peer_id)
    entry = {"peer_id": refusal.peer_id, "message": refusal.message, "at": now}
    r.hset(keys.dedloc_refusals(job_id), str(host_id), json.dumps(entry))
    log.warning(
        "job %s: peer %s (host %s) refused to train it and left: %s", job_id, refusal.peer_id, host_id, refusal.message
    )


def refusals(r: redis.Redis, job_id: int) -> dict[int, dict]:
    """Hosts whose peer refused the job -> {peer_id, message, at}, as `refuse` kept them."""
    return {int(k): json.loads(v) for k, v in r.hgetall(keys.dedloc_refusals(job_id)).items()}


def joined_round(r: redis.Redis, job_id: int) -> Round:
    """The round of a job that peers have joined: it exists (open_job wrote it before anyone could
    join, and nothing deletes it)."""
    rnd = dedloc_document.load(r, job_id)
    assert rnd is not None, f"job {job_id} has peers but no round"
    return rnd


def put_state(
    db: sessionmaker[Session],
    r: redis.Redis,
    storage: Storage,
    evaluator: Evaluator,
    job_id: int,
    host_id: int,
    peer_id: str,
    step: int,
    body: bytes,
    now: float | None = None,
) -> Outcome:
    """Parameters + optimizer state at the start of `step`, uploaded by a member of step - 1's commit
    at `now` (the clock's if None).

    Accepted only when its parameters are those a majority of the commit's members report holding
    (crowdtrain.server.services.dedloc_states: 409 before they agree, 422 and a strike for other
    parameters). Stored once (a second upload of the same step changes nothing), evaluated on the
    validation set and recorded as a Metric; the stop rule is applied here.
    """
    now = now_or_wall(now)
    view = job_view(db, job_id)
    try:
        dedloc_peers.touch(r, job_id, peer_id, host_id, now)
    except NotAMember as exc:
        raise DedlocProblem(RefusalKind.forbidden, str(exc)) from None
    commit = dedloc.commit_of(r, job_id, step - 1) if step >= 1 else None
    if commit is None or peer_id not in commit["members"]:
        raise DedlocProblem(
            RefusalKind.forbidden, f"peer {peer_id} did not commit step {step - 1}: it may not upload state {step}"
        )
    try:
        tensors = decode(body)
        params = {k: v for k, v in tensors.items() if not k.startswith("__")}
        check_against_manifest(params, view.manifest)
    except ValueError as exc:
        raise DedlocProblem(RefusalKind.malformed, str(exc)) from None
    state_digest = math.digest(params)
    judged = dedloc_states.judge_upload(r, job_id, view.spec, commit, peer_id, step, state_digest)
    if judged.verdict is StateVerdict.undecided:
        raise DedlocProblem(RefusalKind.conflict, judged.message)
    if judged.verdict is StateVerdict.refused:
        raise DedlocProblem(RefusalKind.unacceptable, judged.message)
    if not r.set(keys.dedloc_state_claim(job_id, step), peer_id, nx=True):
        return Outcome.duplicate
    storage.put(keys.dedloc_state_key(job_id, step), body)
    with dedloc_document.lock(r, job_id):
        rnd = joined_round(r, job_id)
        rnd.state_step = max(rnd.state_step, step)
        dedloc_document.save(r, job_id, rnd)
    x, y = decode_shard(storage.get(view.validation_key))
    loss, accuracy = evaluator.evaluate(job_id, view.model_config, params, x, y)
    log.info(
        "job %s: state of step %d (digest %s) has validation accuracy %.4f, loss %.4f",
        job_id,
        step,
        state_digest[:12],
        accuracy,
        loss,
    )
    outcome = None
    if accuracy >= view.target_accuracy:
        outcome = (
            JobStatus.succeeded,
            f"step {step} reached validation accuracy {accuracy:.4f} >= {view.target_accuracy}",
        )
    elif step >= view.max_steps:
        outcome = (
            JobStatus.failed,
            f"max_steps={view.max_steps} reached; accuracy {accuracy:.4f} < target {view.target_accuracy}",
        )
    if outcome is not None:
        metadata = model_metadata(job_id, view.name, view.job_spec, view.model_config, step, accuracy)
        storage.put(keys.final_key(job_id), with_metadata(encode(params), metadata))
    ledger_jobs.record_dedloc_state(db, job_id, step, loss, accuracy, sha256(body), outcome)
    if outcome is not None:
        with dedloc_document.lock(r, job_id):
            rnd = joined_round(r, job_id)
            rnd.finished = True
            dedloc_document.save(r, job_id, rnd)
        log.info("job %s %s: %s", job_id, outcome[0].value, outcome[1])
    return Outcome.stored


def latest_state(r: redis.Redis, storage: Storage, job_id: int, host_id: int) -> tuple[int, bytes]:
    """The newest state, for members of the job's collaboration only (others get the missing job's 404)."""
    rnd = dedloc_document.load(r, job_id)
    if rnd is None or not access.is_collaboration_member(r, job_id, host_id):
        raise DedlocProblem(
            RefusalKind.not_found, f"the DeDLOC state of job {job_id} does not exist or you have not joined the job"
        )
    return rnd.state_step, storage.get(keys.dedloc_state_key(job_id, rnd.state_step))


def digests(r: redis.Redis, job_id: int, step: int) -> dict[str, str]:
    return {keys.text(k): keys.text(v) for k, v in r.hgetall(keys.dedloc_digests(job_id, step)).items()}


def aborts(r: redis.Redis, job_id: int) -> dict[str, dict]:
    return {keys.text(k): json.loads(v) for k, v in r.hgetall(keys.dedloc_aborts(job_id)).items()}


def commits(r: redis.Redis, job_id: int) -> dict[int, dict]:
    return {int(k): json.loads(v) for k, v in r.hgetall(keys.dedloc_commits(job_id)).items()}
