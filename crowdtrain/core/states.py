"""The statuses of jobs, workunits and assignments: what the wire, the CLI and the ledger all say.

Which status may follow which is the ledger's business (crowdtrain.server.ledger.states).
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
    # Another assignment of the same workunit (a straggler's duplicate, or the straggler itself)
    # was merged first: this one is not merged, not charged and not credited.
    superseded = "superseded"
    # A replica that agreed with the one merged for its workunit (crowdtrain.assimilator.validator):
    # valid and credited, not merged (W_s takes one result per workunit).
    validated = "validated"

    @property
    def counts_as_error(self) -> bool:
        """Failures charged to the workunit's error count (an abandonment is not the work's fault)."""
        return self in (AssignmentStatus.timed_out, AssignmentStatus.client_error, AssignmentStatus.rejected)
