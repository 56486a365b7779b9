"""One job's merges in one process at a time, in passes over what the job has queued.

A merge task names one uploaded result. The task that finds its job's merge lease free holds it and
merges every result of the job that is ready, oldest first, up to MAX_PASS at a time, into W_s read
once and written once per pass (crowdtrain.assimilator.merge.assimilate_many), and again while
results arrive; a task that finds the lease held returns at once, `queued`: its result was stored
before its task ran, so the holder's next pass takes it (crowdtrain.server.paramstore.lease says
why no request is lost). So more parameter servers serve more jobs, and a second one never makes
one job's merges wait on each other. Replicated results go through their replicas' vote one by
one, as before (crowdtrain.assimilator.merge.assimilate); exactly once either way.
"""

import time
from collections.abc import Callable

from crowdtrain.assimilator.merge import MergeResult, MergeServices, Outcome, assimilate, assimilate_many
from crowdtrain.core import merge_stages
from crowdtrain.core.merge_stages import Stamps
from crowdtrain.server.ledger import merges
from crowdtrain.server.paramstore import lease

# Results merged into one W_s in one pass: each is held in memory (its W_c and Δ) until the pass
# writes W_s, and the lease is renewed between passes.
MAX_PASS = 8


def merge_queued(
    svc: MergeServices, assignment_id: int, stamps: Stamps | None = None, max_pass: int = MAX_PASS
) -> MergeResult:
    """Merge the uploaded result of `assignment_id`, with the rest of its job's queue (`max_pass`
    results a pass) when this process gets the job's merge lease; `queued` when another process
    holds it (and will merge it), or when a pass of another task merged it first. Merged exactly
    once; may be delivered twice. Raises only TRANSIENT errors, as `assimilate` does."""
    pending = merges.pending_merge(svc.db, assignment_id)
    if pending is None or pending.quorum > 1 or pending.already_merged:
        # Nothing to merge, a replica vote, or a delivery that completes what an earlier one recorded.
        return assimilate(svc, assignment_id, stamps)
    own: list[MergeResult] = []
    taken: set[int] = set()

    def drain(renew: Callable[[], object]) -> None:
        while ready := merges.ready_to_merge(svc.db, pending.job_id, max_pass):
            if taken.issuperset(p.assignment_id for p, _ in ready):
                return  # every outcome ends a result: one still uploaded is the transitioner's to queue again
            started = time.time()
            queued = [
                (p.assignment_id, stamps if p.assignment_id == assignment_id else _taken_up(at, started))
                for p, at in ready
            ]
            results = assimilate_many(svc, queued, {p.assignment_id: p for p, _ in ready})
            taken.update(aid for aid, _ in queued)
            own.extend(result for (aid, _), result in zip(queued, results, strict=True) if aid == assignment_id)
            renew()
            if len(ready) < max_pass:
                return

    lease.serve(svc.r, pending.job_id, drain)
    return own[0] if own else MergeResult(Outcome.queued)


def _taken_up(uploaded_at: float, started: float) -> Stamps:
    """The stamps of a result a pass takes from the job's queue: its upload's time, and the pass's start."""
    stamps = merge_stages.received(uploaded_at)
    merge_stages.stamp(stamps, "started", started)
    return stamps
