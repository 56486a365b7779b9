"""The one place where job, workunit and assignment statuses change.

Every status write goes through `move()`, which checks the table of legal transitions below.
"""

from enum import StrEnum

from crowdtrain.core.refusals import Refusal, RefusalKind
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus

J, W, A = JobStatus, WorkunitStatus, AssignmentStatus

TRANSITIONS: dict[type, dict[StrEnum, frozenset[StrEnum]]] = {
    JobStatus: {
        J.pending: frozenset({J.running, J.failed, J.cancelled}),
        J.running: frozenset({J.succeeded, J.failed, J.cancelled}),
    },
    WorkunitStatus: {
        # ready -> done: W_s holds a result of the workunit whose assignment the ledger had ended
        # (crowdtrain.server.ledger.merges.record_merges).
        W.ready: frozenset({W.in_progress, W.cancelled, W.done}),
        W.in_progress: frozenset({W.ready, W.done, W.failed, W.cancelled}),
    },
    AssignmentStatus: {
        A.in_progress: frozenset({A.uploaded, A.rejected, A.timed_out, A.abandoned, A.client_error, A.superseded}),
        A.uploaded: frozenset({A.merged, A.rejected, A.superseded, A.validated}),
        # rejected -> merged: a merge pass wrote the result into W_s while another process ended it
        # (crowdtrain.server.ledger.merges.record_merges); W_s is what the ledger records.
        A.rejected: frozenset({A.merged}),
    },
}


class IllegalTransition(Refusal):
    """A status change the table does not allow: a request that asks for it conflicts with the current state."""

    kind = RefusalKind.conflict

    def __init__(self, what: str, obj_id: object, current: str, new: str):
        super().__init__(f"{what} {obj_id}: cannot go from {current} to {new}")
        self.current = current
        self.new = new


def can_move(enum: type[StrEnum], current: str, new: str) -> bool:
    return enum(new) in TRANSITIONS[enum].get(enum(current), frozenset())


def move(obj, new: StrEnum) -> None:
    """Set `obj.status` to `new` if the table allows it, else raise IllegalTransition."""
    enum = type(new)
    if not can_move(enum, obj.status, new):
        raise IllegalTransition(type(obj).__name__, getattr(obj, "id", None), obj.status, new)
    obj.status = new.value
