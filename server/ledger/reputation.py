"""A host's record, kept as its results end: valid, failed (refused, timed out, client error) and
quarantine (crowdtrain.core.reputation). Called inside the transaction that ends the result, with
the host's row locked."""

import logging
from datetime import datetime

from crowdtrain.core import reputation
from crowdtrain.core.jobspec import validation_of
from crowdtrain.core.logs import ids
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.models import Host, Job, utcnow

log = logging.getLogger(__name__)


def count_valid(host: Host, turnaround: float | None) -> None:
    """A valid result (merged, or a replica that agreed with the merged one): the runs of valid and
    refused results, and the mean turnaround (an exponential average)."""
    host.results_valid += 1
    host.consecutive_valid += 1
    host.consecutive_refused = 0
    if turnaround is not None:
        host.mean_turnaround = (
            turnaround if host.mean_turnaround is None else (0.8 * host.mean_turnaround + 0.2 * turnaround)
        )


def count_failure(host: Host, job: Job, outcome: AssignmentStatus, message: str) -> None:
    """A result of `job` charged to its host: its run of valid results ends; a refused one extends the
    run of refusals, which quarantines the host at the job's validation.quarantine_after."""
    host.results_failed += 1
    host.consecutive_valid = 0
    if outcome is not AssignmentStatus.rejected:
        return
    host.consecutive_refused += 1
    reason = reputation.quarantine_reason(host.consecutive_refused, message, validation_of(job.spec).quarantine_after)
    if reason is not None and not is_quarantined(host):
        host.quarantined_until = utcnow() + reputation.QUARANTINE_FOR
        host.quarantine_reason = reason
        log.warning(
            "host %s: quarantined until %s: %s", host.id, host.quarantined_until, reason, extra=ids(host_id=host.id)
        )


def is_quarantined(host: Host) -> bool:
    return quarantined(host.quarantined_until)


def quarantined(until: datetime | None) -> bool:
    """Whether a host quarantined `until` (None: never) is still in quarantine."""
    return until is not None and until > utcnow()


def release(host: Host) -> None:
    """The operator lets a quarantined host work again (on probation: its runs start over)."""
    host.quarantined_until = None
    host.quarantine_reason = ""
    host.consecutive_refused = 0
