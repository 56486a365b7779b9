"""The in-memory half of a merge pass: results applied in order to one copy of W_s and its rule state.

A parameter server merges what is queued for a job in one pass (crowdtrain.server.paramstore.store
.merge_batch): it reads W_s once, applies each result in turn here, and writes W_s once. Applied one
after another, k results leave W_s, the rule's state, the versions and the recent update norms
exactly as k single merges would: each result sees the version and the norms that the results
before it left. No I/O.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from crowdtrain.core.merge_stages import Stamps
from crowdtrain.core.tensors import Params
from crowdtrain.server.paramstore.cache import CachedModel

NORMS_KEPT = 50  # accepted update norms remembered per job: the window of the norm bound's median

# (W_s, rule state, version, recent update norms newest first) -> None once the result is merged into
# W_s and the state, both in place; or why it is refused, having changed nothing.
Step = Callable[[Params, Params, int, Sequence[float]], str | None]


@dataclass(frozen=True)
class QueuedResult:
    """One result of a pass: its assignment, how to merge it, and what is recorded with it."""

    assignment_id: int
    step: Step
    stamps: Stamps | None = None  # its merge stages so far (crowdtrain.core.merge_stages), kept in the merge log
    update_norm: float | None = None  # recorded among the recent norms once merged
    workunit_id: int | None = None  # W_s takes one result per workunit


class Taken(StrEnum):
    merged = "merged"  # merged into W_s by this pass
    already_merged = "already merged"  # an earlier pass (a redelivered task) merged it
    refused = "refused"  # its step refused it: W_s and the state are as they were
    superseded = "superseded"  # W_s holds another assignment of its workunit


@dataclass(frozen=True)
class Taking:
    """What a pass did with one result."""

    assignment_id: int
    taken: Taken
    version: int | None = None  # the W_s version that holds it (merged, already merged)
    reason: str = ""  # why its step refused it
    winner: int | None = None  # superseded: the assignment W_s took its workunit from


@dataclass
class Pass:
    """Results applied in order to `model` from W_s `version`: what each became, and what to write."""

    model: CachedModel
    version: int
    norms: list[float]  # newest first, as Redis keeps them
    owners: dict[int, int] = field(default_factory=dict)  # workunit -> assignment merged by this pass
    merged: list[tuple[QueuedResult, int]] = field(default_factory=list)  # each with the version holding it

    def apply(self, result: QueuedResult) -> Taking:
        """Merge `result` next, unless its workunit was merged earlier in this pass or its step refuses it."""
        winner = self.owners.get(result.workunit_id) if result.workunit_id is not None else None
        if winner is not None:
            return Taking(result.assignment_id, Taken.superseded, winner=winner)
        refusal = _run_step(result.step, self.model, self.version, self.norms)
        if refusal is not None:
            return Taking(result.assignment_id, Taken.refused, reason=refusal)
        self.version += 1
        self.merged.append((result, self.version))
        if result.workunit_id is not None:
            self.owners[result.workunit_id] = result.assignment_id
        if result.update_norm is not None:
            self.norms.insert(0, result.update_norm)
            del self.norms[NORMS_KEPT:]
        return Taking(result.assignment_id, Taken.merged, self.version)


def _run_step(step: Step, model: CachedModel, version: int, norms: Sequence[float]) -> str | None:
    """Run `step` on the model's W_s and state, which it must change in place, never replacing an array."""
    params, state = dict(model.params), dict(model.state)
    refusal = step(model.params, model.state, version, tuple(norms))
    if (
        model.params.keys() != params.keys()
        or any(model.params[k] is not params[k] for k in params)
        or model.state.keys() != state.keys()
        or any(model.state[k] is not state[k] for k in state)
    ):
        raise ValueError("merge functions must update W_s and the rule's state in place")
    return refusal
