"""A host's record, kept as its results end: valid, failed (refused, timed out, client error) and
quarantine (crowdtrain.core.reputation). Called inside the transaction that ends the result, with
the host's row locked; a newly registered host inherits the quarantine of its account or network."""

import logging
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from crowdtrain.core import reputation
from crowdtrain.core.logs import ids
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.validationspec import validation_of
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
    _quarantine_if_due(host, message, validation_of(job.spec).quarantine_after)


def count_refused_answers(host: Host, refused: int, message: str, after: int | None) -> None:
    """`refused` answers of an expert host that trainers could not use (NaN, wrong shapes): charged as
    refused results are, the run of refusals quarantining the host at `after` (a job's
    validation.quarantine_after)."""
    host.results_failed += refused
    host.consecutive_valid = 0
    host.consecutive_refused += refused
    _quarantine_if_due(host, message, after)


def _quarantine_if_due(host: Host, message: str, after: int | None) -> None:
    reason = reputation.quarantine_reason(host.consecutive_refused, message, after)
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


def quarantine_to_inherit(s: Session, account: str, network: str, now: datetime) -> Host | None:
    """The quarantined host whose quarantine a host registering now under `account` from `network` inherits
    ("" for either: that one is not followed): of the hosts of that account or network still in quarantine at
    `now`, the one quarantined longest (the first of them, should several end together); None if none is.

    A quarantine that a new registration could shed would be no quarantine: the same volunteer registers again
    with the same join token, name and account, and gets work at once."""
    followed = [column == value for column, value in ((Host.account, account), (Host.network, network)) if value]
    if not followed:
        return None
    return s.scalars(
        select(Host)
        .where(or_(*followed), Host.quarantined_until > now)
        .order_by(Host.quarantined_until.desc(), Host.id)
        .limit(1)
    ).first()


def inherit_quarantine(host: Host, source: Host) -> None:
    """`host` is quarantined until `source` is, for its reason, and starts from its record (its low reputation
    and its run of refusals), not from a new host's benefit of the doubt."""
    host.quarantined_until = source.quarantined_until
    host.quarantine_reason = (
        source.quarantine_reason
        if source.quarantine_reason.startswith("as host ")
        else f"as host {source.id} of the same account or network: {source.quarantine_reason}"
    )[:500]
    host.results_valid = source.results_valid
    host.results_failed = source.results_failed
    host.consecutive_refused = source.consecutive_refused
    host.consecutive_valid = 0
