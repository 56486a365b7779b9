"""The one place where job, workunit and assignment statuses change.

Every status write goes through `move()`, which checks the table of legal transitions below.
"""

from enum import StrEnum


class JobStatus(StrEnum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class WorkunitStatus(StrEnum):
    ready = "ready"
    in_progress = "in_progress"
    done = "done"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (WorkunitStatus.done, WorkunitStatus.failed, WorkunitStatus.cancelled)


class AssignmentStatus(StrEnum):
    in_progress = "in_progress"
    uploaded = "uploaded"
    merged = "merged"
    rejected = "rejected"
    timed_out = "timed_out"
    abandoned = "abandoned"
    client_error = "client_error"

    @property
    def counts_as_error(self) -> bool:
        """Failures charged to the workunit's error count (an abandonment is not the work's fault)."""
        return self in (AssignmentStatus.timed_out, AssignmentStatus.client_error, AssignmentStatus.rejected)


J, W, A = JobStatus, WorkunitStatus, AssignmentStatus

TRANSITIONS: dict[type, dict[StrEnum, frozenset[StrEnum]]] = {
    JobStatus: {
        J.pending: frozenset({J.running, J.failed, J.cancelled}),
        J.running: frozenset({J.succeeded, J.failed, J.cancelled}),
    },
    WorkunitStatus: {
        W.ready: frozenset({W.in_progress, W.cancelled}),
        W.in_progress: frozenset({W.ready, W.done, W.failed, W.cancelled}),
    },
    AssignmentStatus: {
        A.in_progress: frozenset({A.uploaded, A.rejected, A.timed_out, A.abandoned, A.client_error}),
        A.uploaded: frozenset({A.merged, A.rejected}),
    },
}


class IllegalTransition(Exception):
    def __init__(self, kind: str, obj_id: object, current: str, new: str):
        super().__init__(f"{kind} {obj_id}: cannot go from {current} to {new}")
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
