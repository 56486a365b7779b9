"""What a merge pass leaves behind once W_s holds its results: their validation figures (W_s evaluated
once per pass, when one of its versions is due), the divergence stop, the snapshot dispatch hands out
next, the ledger's rows, the uploads deleted, and the epochs closed that are complete."""

import logging
from collections.abc import Sequence
from typing import Any

from crowdtrain.assimilator.inputs import validation_set
from crowdtrain.assimilator.merge_services import TRANSIENT, JobBroken, MergeServices
from crowdtrain.assimilator.policy import Policy
from crowdtrain.core import rounds
from crowdtrain.core.keys import snapshot_key
from crowdtrain.core.logs import ids
from crowdtrain.core.tensors import sha256
from crowdtrain.server.ledger import merges, result_records, snapshot_list
from crowdtrain.server.ledger.epochs import close_epoch_if_complete
from crowdtrain.server.ledger.job_end import fail_job
from crowdtrain.server.paramstore import store

log = logging.getLogger(__name__)


def record_merged(svc: MergeServices, merged: Sequence[tuple[merges.PendingMerge, int]]) -> None:
    """Record results of one job that W_s holds, each at its version. W_s is evaluated once, when one
    of those versions is due (`eval_every`), and its figure recorded for the last result of each
    epoch here: a pass that fell behind evaluates the version it wrote, not every merge. The metric
    is recorded before the workunits are marked done: when an epoch's last workunit is done, its
    merges have their validation figures."""
    if not merged:
        return
    last = merged[-1][0]
    # One the ledger shows merged had its turn to be measured before it was marked merged.
    unrecorded = [(p, version) for p, version in merged if not p.already_merged]
    if any(rounds.evaluation_due(last.spec, version) for _, version in unrecorded):
        _record_metrics(svc, list({p.epoch: p for p, _ in unrecorded}.values()))
        _stop_if_diverged(svc, last)
    _publish_snapshot_if_due(svc, last.job_id, last.spec, max(version for _, version in merged))
    superseded = merges.record_merges(svc.db, [(p.assignment_id, version) for p, version in merged])
    for key in [*(p.upload_key for p, _ in merged), *superseded]:
        svc.storage.delete(key)
    for p, _ in merged:
        result_records.forget_checked_upload(svc.r, p.job_id, p.upload_key)
    for epoch in sorted({p.epoch for p, _ in merged}):
        close_epoch_if_complete(svc.db, svc.storage, svc.r, last.job_id, epoch, svc.evaluator)


def _record_metrics(svc: MergeServices, measured: Sequence[merges.PendingMerge]) -> None:
    """Evaluate W_s on the job's validation set once, and record it for each of `measured` that has no
    figure yet; JobBroken when that cannot work."""
    unmeasured = [(p, merges.unmeasured_validation_key(svc.db, p.job_id, p.assignment_id)) for p in measured]
    unmeasured = [(p, key) for p, key in unmeasured if key is not None]
    if not unmeasured:
        return
    p, validation_key = unmeasured[-1]
    assert validation_key is not None
    version, params = store.read(svc.r, p.job_id)
    try:
        x, y = validation_set(svc.storage, validation_key)
        loss, acc = svc.evaluator.evaluate(p.job_id, p.model_config, params, x, y)
    except TRANSIENT:
        raise
    except Exception as exc:
        raise JobBroken(
            f"evaluating W_s v{version} on the job's validation set failed: {type(exc).__name__}: {exc}"
        ) from exc
    for p, _ in unmeasured:
        merges.record_metric(svc.db, p.job_id, p.epoch, p.assignment_id, version, loss, acc)
    log.info("job %s: W_s v%d validation accuracy %.4f loss %.4f (epoch %d)", p.job_id, version, acc, loss, p.epoch)


def _stop_if_diverged(svc: MergeServices, p: merges.PendingMerge) -> None:
    """Fail the job, saying why, when its validation losses show W_s diverging (Policy.divergence):
    merging more would make it worse, and the operator should lower the rule's step."""
    policy = Policy.from_spec(p.spec["assimilation"])
    best, latest = merges.validation_losses(svc.db, p.job_id, policy.divergence_patience)
    why = policy.divergence(best, latest)
    if why is None:
        return
    message = (
        f"W_s diverged: {why}. Merging more would make it worse: lower the rule's step "
        "(assimilation.server_lr, or a higher alpha for vc-asgd) or the clients' learning rate; "
        "assimilation.divergence_factor sets this bound"
    )
    if fail_job(svc.db, svc.storage, svc.r, p.job_id, message, svc.evaluator):
        log.warning("job %s failed: %s", p.job_id, message, extra=ids(job_id=p.job_id))


def _publish_snapshot_if_due(svc: MergeServices, job_id: int, spec: dict[str, Any], version: int) -> None:
    """Publish W_s for dispatch at most once per `snapshot_every_merges` merges or seconds, or at each
    round's end (crowdtrain.core.rounds.snapshot_due). Before the merges are recorded: a job in rounds
    opens its next round when they are, with this snapshot."""
    last_v, age = merges.last_snapshot(svc.db, job_id)
    if not rounds.snapshot_due(spec, version, last_v, age):
        return
    current, blob = store.read_blob(svc.r, job_id)
    key = snapshot_key(job_id, current)
    svc.storage.put(key, blob)
    if not merges.record_snapshot(svc.db, job_id, current, key, sha256(blob)):
        return
    # Only the newest few snapshots are kept, and none that an unmerged assignment started from.
    expired = snapshot_list.note_snapshot(svc.r, job_id, current, svc.snapshots_kept)
    if not expired:
        return
    in_use = merges.snapshots_in_use(svc.db, job_id, expired)
    for old in expired:
        if old in in_use:
            snapshot_list.keep_snapshot(svc.r, job_id, old)
        else:
            svc.storage.delete(snapshot_key(job_id, old))
