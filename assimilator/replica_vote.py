"""The replica vote of a replicated workunit: measure its uploaded replicas, judge them
(crowdtrain.assimilator.validator), and record the verdict (crowdtrain.server.ledger.replicas).

The merge (crowdtrain.assimilator.merge) calls `judge_replicas` for a replica that is not the
workunit's canonical one yet, and merges the replica the vote names. Each replica is read once
(crowdtrain.assimilator.inputs.read_result), W_s and its rule's state once per vote.
"""

import logging
import math
from dataclasses import dataclass, replace

import numpy as np
import redis
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator import evidence, validator
from crowdtrain.assimilator.inputs import Refused, holdout, read_result, replay_reason
from crowdtrain.assimilator.policy import Policy, merged_alone
from crowdtrain.assimilator.rules import make_rule
from crowdtrain.core.assimilationspec import assimilation_of
from crowdtrain.core.logs import ids
from crowdtrain.core.storage import Storage
from crowdtrain.core.tensors import decode_shard
from crowdtrain.core.validationspec import ValidationSpec, validation_of
from crowdtrain.server.ledger import merges, replicas, result_records
from crowdtrain.server.ledger.epochs import close_epochs_after_failure
from crowdtrain.server.ledger.job_end import Evaluator
from crowdtrain.server.paramstore import store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Vote:
    """What the vote means for the replica it was called for."""

    canonical: int | None = None  # the replica to merge; None while the vote awaits replicas
    refused: str | None = None  # why this replica is refused, once the vote is decided against it


def judge_replicas(
    db: sessionmaker[Session], storage: Storage, r: redis.Redis, evaluator: Evaluator, p: merges.PendingMerge
) -> Vote:
    """Judge the workunit's replicas once `quorum` of them are uploaded and record the verdict; before
    that, the vote awaits the others (Vote()). A decided vote names its canonical replica, which the
    caller merges (this one, or another whose own merge ended while it waited)."""
    uploaded = replicas.uploads(db, p.workunit_id)
    if len(uploaded) < p.quorum:
        log.info(
            "assignment %s: %d of %d replicas uploaded; waiting for the others",
            p.assignment_id,
            len(uploaded),
            p.quorum,
            extra=ids(job_id=p.job_id, workunit_id=p.workunit_id, assignment_id=p.assignment_id),
        )
        return Vote()
    spec = validation_of(p.spec)
    measured, malformed, flat, base_loss = measure_replicas(db, storage, r, evaluator, p, uploaded, spec)
    verdict = validator.judge(measured, validator.cosines(flat), base_loss, spec)
    if verdict.more and malformed:
        # A malformed replica ends the vote: the others are judged as at the bound (inconclusive unless
        # two agree), never left valid by default.
        bound = spec.model_copy(update={"max_replicas": len(measured)})
        verdict = validator.judge(measured, validator.cosines(flat), base_loss, bound)
    invalid = {**verdict.invalid, **malformed}
    record = replicas.record_verdict(
        db,
        p.workunit_id,
        [u.assignment_id for u in uploaded],
        verdict.canonical if verdict.canonical not in malformed else None,
        verdict.more and not malformed,
        invalid,
        verdict.charged | frozenset(malformed),
        spec.max_replicas,
    )
    for key in record.ended:
        storage.delete(key)
    if record.failed_workunit:
        close_epochs_after_failure(db, storage, r, [(p.job_id, p.epoch)], evaluator)
    refused = invalid[p.assignment_id] if p.assignment_id in invalid and record.decided else None
    return Vote(record.canonical, refused)


def measure_replicas(
    db: sessionmaker[Session],
    storage: Storage,
    r: redis.Redis,
    evaluator: Evaluator,
    p: merges.PendingMerge,
    uploaded: list[replicas.Upload],
    spec: ValidationSpec,
) -> tuple[list[validator.Replica], dict[int, str], dict[int, np.ndarray], float]:
    """Each replica's ||Δ||, the held-out loss of W_s after the job's rule merged it alone
    (crowdtrain.assimilator.policy.merged_alone) and its evidence of training on the workunit's shard
    (crowdtrain.assimilator.evidence), its flat Δ, and the held-out loss of W_s itself; a result that cannot be
    read as an update, or that replays an earlier one, is invalid at once (assignment id -> why)."""
    version, server, state = store.read_with_state(r, p.job_id)
    assimilation = assimilation_of(p.spec["assimilation"])  # read once, for the rule and the policy
    rule, policy = make_rule(assimilation), Policy.from_spec(assimilation)
    state = rule.initial_state(server) if state is None else state
    x, y = holdout(storage, p.job_id, spec.holdout_examples)
    checked = spec.min_training_z is not None or spec.min_descent_z is not None
    shard = _shard_examples(db, storage, p.workunit_id, spec) if checked else None
    rng = np.random.default_rng()  # this process's entropy: the random directions no host can know
    measured, malformed, flat = [], {}, {}
    for u in uploaded:
        try:
            result = read_result(
                storage,
                r,
                replace(p, assignment_id=u.assignment_id, base_version=u.base_version, upload_key=u.upload_key),
            )
        except Refused as exc:
            malformed[u.assignment_id] = exc.reason
            continue
        first = result_records.first_with_digest(r, p.job_id, result.digest, u.assignment_id)
        if first != u.assignment_id:
            malformed[u.assignment_id] = replay_reason(first)
            continue
        update = replace(result.update, staleness=version - u.base_version)
        moved = merged_alone(policy, rule, server, state, update)
        loss, _ = evaluator.evaluate(p.job_id, p.model_config, moved, x, y)
        flat[u.assignment_id] = validator.flat_update(update.delta)
        z, descent = (
            evidence.measure(p.job_id, p.model_config, update.client, update.delta, shard, spec.descent_directions, rng)
            if shard is not None
            else (math.inf, math.inf)
        )
        size = float(np.linalg.norm(flat[u.assignment_id]))
        measured.append(validator.Replica(u.assignment_id, size, loss, z, descent))
    base_loss, _ = evaluator.evaluate(p.job_id, p.model_config, server, x, y)
    return measured, malformed, flat, base_loss


def _shard_examples(
    db: sessionmaker[Session], storage: Storage, workunit_id: int, spec: ValidationSpec
) -> tuple[np.ndarray, np.ndarray]:
    """The first `training_examples` of the workunit's shard, as its hosts read it."""
    x, y = decode_shard(storage.get(replicas.shard_key(db, workunit_id)))
    return x[: spec.training_examples], y[: spec.training_examples]
