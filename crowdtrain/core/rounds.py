"""Semi-synchronous rounds (`scheduling.rounds`), as the scheduler, the parameter servers and the
simulator all read them. No I/O.

A round is the fedbuff buffer: `assimilation.buffer_size` (K) results that all trained from one W_s and
that the rule combines in one outer step (DiLoCo's outer Nesterov, Douillard et al. 2023, with
`outer_optimizer: nesterov`). W_s's version moves by one per merged result, and the buffer fills
and empties in step with it, so the rounds' ends are the versions that are multiples of K. Dispatch
keeps at most K of a job's results unmerged or buffered (`budget`); the next round opens when the
last result of a round is merged, and the parameter servers publish that version's snapshot before
they record the merge, so every workunit of the new round is dispatched with it. Snapshots and
evaluations of the versions inside a round would show an unchanged W_s: only the rounds' ends are
published and evaluated.
"""

from typing import Any

from crowdtrain.core.assimilationspec import buffer_size_of
from crowdtrain.core.jobspec import scheduling_of


def round_size(spec: dict[str, Any]) -> int | None:
    """K, the results of one round, for a stored job spec in rounds; None when it is not in rounds."""
    if not scheduling_of(spec).rounds:
        return None
    return buffer_size_of(spec)


def budget(size: int, version: int) -> int:
    """The results a job in rounds of `size` may have dispatched or uploaded but unmerged when W_s is at
    `version` (the newest the ledger has recorded merged): what is left of the current round."""
    return size - version % size


def evaluation_due(spec: dict[str, Any], version: int) -> bool:
    """Whether W_s at `version` is evaluated: every `eval_every` merges, or in rounds every `eval_every`
    rounds' ends."""
    every = scheduling_of(spec).eval_every * (round_size(spec) or 1)
    return version % every == 0


def snapshot_due(spec: dict[str, Any], version: int, published: int, age: float | None) -> bool:
    """Whether W_s at `version` is published for dispatch when `published` is the newest snapshot's
    version, `age` seconds old (None: none yet): once `snapshot_every_merges` merges or
    `snapshot_every_seconds` have passed, or in rounds when `version` ends a round after `published`."""
    if version <= published:
        return False
    size = round_size(spec)
    if size is not None:
        return version // size > published // size
    sched = scheduling_of(spec)
    return version - published >= sched.snapshot_every_merges or (
        age is not None and age >= sched.snapshot_every_seconds
    )
