"""The exactly-once merge transaction: a pass of results merged into W_s and its rule's state.

A merge pass is an optimistic transaction: WATCH the version and the merged-set, apply the pass's
results in order to W_s read once (crowdtrain.server.paramstore.steps), then MULTI/EXEC the new
chunks of W_s and of the rule's state, the new version and every merged assignment id together.
Two parameter servers racing on one job retry; a redelivered task finds its id in the merged-set
and does nothing. So every assignment is merged exactly once, however often its task runs and
whichever pass takes it, and its effect on the rule's state (one momentum step, one buffered update)
too. The transaction also watches the workunit -> assignment map: of a straggler and its duplicate,
the first to merge is the only one W_s takes. The state is written only with the version, so
watching the version covers it.

A parameter-server process keeps the W_s it wrote last, with the random tag written beside it
(`keys.params_tag`); a merge that finds that tag in Redis reads only the small keys, not W_s. Any
other write of W_s (another process's merge, a restore) writes another tag, and the next merge here
reads W_s again. Which process merges a job's results is the merge lease's concern
(crowdtrain.server.paramstore.lease); nothing here rests on it.

Once a job's merges are closed (crowdtrain.server.paramstore.store.close_merges), every transaction
here fails with MergesClosed.
"""

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import redis
from redis.typing import EncodableT

from crowdtrain.core import keys, merge_stages
from crowdtrain.core.merge_stages import Stamps
from crowdtrain.core.tensors import Params
from crowdtrain.server.paramstore import cache, store
from crowdtrain.server.paramstore.cache import CachedModel
from crowdtrain.server.paramstore.steps import NORMS_KEPT, Pass, QueuedResult, Taken, Taking

Merge = Callable[[Params, Params, int], Params]  # (W_s, rule state, version) -> W_s, both changed in place


class MergesClosed(RuntimeError):
    """The job stopped running: its W_s takes no more merges."""


class WorkunitMerged(RuntimeError):
    """W_s already holds another assignment's result for this workunit (`assignment_id`)."""

    def __init__(self, workunit_id: int, assignment_id: int):
        super().__init__(f"workunit {workunit_id} was merged from assignment {assignment_id}")
        self.assignment_id = assignment_id


@dataclass(frozen=True)
class MergeOutcome:
    version: int  # version of W_s that includes this assignment
    applied_now: bool  # False when an earlier delivery already merged it


def merged_version(r: redis.Redis, job_id: int, assignment_id: int) -> int | None:
    raw = r.hget(keys.merge_log(job_id), str(assignment_id))
    return None if raw is None else int(json.loads(raw)["version"])


def recent_update_norms(r: redis.Redis, job_id: int) -> list[float]:
    """Norms of the job's last `NORMS_KEPT` merged updates, newest first."""
    return [float(v) for v in r.lrange(keys.update_norms(job_id), 0, -1)]


def merge_once(
    r: redis.Redis,
    job_id: int,
    assignment_id: int,
    merge: Merge,
    stamps: Stamps | None = None,
    update_norm: float | None = None,
    initial_state: Callable[[Params], Params] | None = None,
    workunit_id: int | None = None,
) -> MergeOutcome:
    """Apply `merge(W_s, state, version)` exactly once for `assignment_id`, and, given its
    `workunit_id`, at most once per workunit: when W_s already holds another assignment of the
    workunit (a straggler and its duplicate both uploaded), raises WorkunitMerged, writing nothing.

    `merge` updates W_s and the rule's state in place (and returns W_s), or raises to refuse the
    result; either way nothing is written unless the whole transaction commits. A pass of one
    result (`merge_batch`, which says the rest).
    """

    def step(server: Params, state: Params, version: int, _norms: Sequence[float]) -> None:
        if merge(server, state, version) is not server:
            raise ValueError("merge functions must update W_s and the rule's state in place")

    queued = QueuedResult(assignment_id, step, stamps, update_norm, workunit_id)
    [taking] = merge_batch(r, job_id, [queued], initial_state)
    if taking.taken is Taken.superseded:
        raise WorkunitMerged(cast(int, workunit_id), cast(int, taking.winner))
    assert taking.version is not None  # a step that raises is merge_once's only refusal
    return MergeOutcome(taking.version, applied_now=taking.taken is Taken.merged)


def merge_batch(
    r: redis.Redis,
    job_id: int,
    results: Sequence[QueuedResult],
    initial_state: Callable[[Params], Params] | None = None,
) -> list[Taking]:
    """Merge `results` in order, each exactly once, into W_s read once and written once: what each became.

    Each result's step runs on W_s and the rule's state as the results before it left them, with
    the version and recent update norms they left (crowdtrain.server.paramstore.steps), so k
    results in one pass equal k single merges. W_s, the state, the version, the recent norms and
    every merged assignment id (the merged-set, the workunit map, the merge log) change together
    in one MULTI/EXEC, or not at all. A result W_s already holds is `already_merged`; one whose
    workunit W_s holds from another assignment, `superseded`; one its step refuses, `refused`.
    When Redis holds no state yet, it starts as `initial_state(W_s)` (empty without one). Raises
    MergesClosed once the job's merges are closed, and whatever a step raises, writing nothing.
    """
    with r.pipeline() as pipe:
        while True:
            try:
                takings = _merge_attempt(r, pipe, job_id, results, initial_state)
            except redis.WatchError:
                continue
            if takings is not None:
                return takings


def _merge_attempt(
    r: redis.Redis,
    pipe: redis.client.Pipeline,
    job_id: int,
    results: Sequence[QueuedResult],
    initial_state: Callable[[Params], Params] | None,
) -> list[Taking] | None:
    """One optimistic try: what each result became, or None to try again (W_s moved while it was
    read); raises WatchError when the EXEC lost to another write."""
    vkey, members = keys.version(job_id), [str(q.assignment_id) for q in results]
    pipe.watch(vkey, keys.merged(job_id), keys.closed(job_id), keys.merged_workunits(job_id))
    # Read on another connection, in one round trip: a change after the WATCH fails the EXEC anyway.
    with r.pipeline(transaction=False) as reads:
        reads.smismember(keys.merged(job_id), members)
        reads.exists(keys.closed(job_id))
        reads.hmget(keys.merged_workunits(job_id), [str(q.workunit_id) for q in results])
        reads.mget(vkey, keys.params_tag(job_id))
        reads.lrange(keys.update_norms(job_id), 0, -1)
        merged, closed, owners, (raw_version, raw_tag), norms = reads.execute()
    if closed or raw_version is None:
        pipe.unwatch()
        if closed:
            raise MergesClosed(f"job {job_id} is no longer running")
        raise store.NoServerModel(f"job {job_id} has no server model in Redis")
    settled = {q.assignment_id: _settled(r, job_id, q, m, o) for q, m, o in zip(results, merged, owners, strict=True)}
    todo = [q for q in results if settled[q.assignment_id] is None]
    version, tag = int(raw_version), None if raw_tag is None else keys.text(raw_tag)
    cached = cache.take(job_id, tag) if todo else None
    if todo and cached is None:
        blobs = store.read_blobs(r, job_id, with_state=True)
        cached = CachedModel.of(blobs.tag, blobs.version, blobs.params, blobs.state, initial_state)
        if (cached.version, cached.tag) != (version, tag):
            pipe.unwatch()
            return None  # another merge landed in between; start over
    if cached is None:
        pipe.unwatch()
        return [cast(Taking, settled[q.assignment_id]) for q in results]
    merging = Pass(cached, version, [float(n) for n in norms])
    for q in todo:
        settled[q.assignment_id] = merging.apply(q)
        merge_stages.stamp(q.stamps, "applied")
    if merging.merged:
        pipe.multi()
        _queue_merge_writes(pipe, job_id, merging)
        pipe.execute()
        merged_at = time.time()
        for q, _ in merging.merged:
            merge_stages.stamp(q.stamps, "merged", merged_at)
        log: dict[EncodableT, EncodableT] = {
            str(q.assignment_id): _log_entry(v, q.stamps, merged_at) for q, v in merging.merged
        }
        r.hset(keys.merge_log(job_id), mapping=log)
    else:
        pipe.unwatch()
    cache.keep(job_id, cached)  # written, or unchanged: every step refused
    return [cast(Taking, settled[q.assignment_id]) for q in results]


def _settled(r: redis.Redis, job_id: int, q: QueuedResult, merged: int, owner: bytes | None) -> Taking | None:
    """What a result already is before the pass (merged by an earlier one, or its workunit from
    another assignment), or None when the pass is to merge it."""
    if merged:
        return Taking(q.assignment_id, Taken.already_merged, merged_version(r, job_id, q.assignment_id) or 0)
    if q.workunit_id is not None and owner is not None:
        return Taking(q.assignment_id, Taken.superseded, winner=int(owner))
    return None


def _log_entry(version: int, stamps: Stamps | None, merged_at: float | None = None) -> str:
    """A merge log entry: the version of W_s that holds the result, when its body was in hand
    (`received_at`, None when not timed) and W_s was written (`merged_at`, once the pass committed),
    and every stage's stamp when timed (crowdtrain.core.merge_stages)."""
    entry: dict[str, object] = {"version": version, "received_at": None if stamps is None else stamps.get("received")}
    if merged_at is not None:
        entry["merged_at"] = merged_at
    if stamps:
        entry["stamps"] = stamps
    return json.dumps(entry)


def _queue_merge_writes(pipe: redis.client.Pipeline, job_id: int, merging: Pass) -> None:
    """The MULTI of a pass: W_s, its state, version and new tag once, and the records of every merged assignment."""
    cached = merging.model
    cached.version, cached.tag = merging.version, store.new_tag()
    store.queue_blob_write(pipe, job_id, cached.blob)
    store.queue_state_write(pipe, job_id, cached.state_blob)
    pipe.set(keys.version(job_id), merging.version)
    pipe.set(keys.params_tag(job_id), cached.tag)
    pipe.sadd(keys.merged(job_id), *(str(q.assignment_id) for q, _ in merging.merged))
    workunits: dict[EncodableT, EncodableT] = {
        str(q.workunit_id): str(q.assignment_id) for q, _ in merging.merged if q.workunit_id is not None
    }
    if workunits:
        pipe.hset(keys.merged_workunits(job_id), mapping=workunits)
    log: dict[EncodableT, EncodableT] = {str(q.assignment_id): _log_entry(v, q.stamps) for q, v in merging.merged}
    pipe.hset(keys.merge_log(job_id), mapping=log)
    norms = [q.update_norm for q, _ in merging.merged if q.update_norm is not None]
    if norms:
        pipe.lpush(keys.update_norms(job_id), *norms)
        pipe.ltrim(keys.update_norms(job_id), 0, NORMS_KEPT - 1)
    pipe.delete(keys.merge_failures(job_id))
