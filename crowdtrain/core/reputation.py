"""A host's reputation: what its record of valid, refused and timed-out results says of it. No I/O.

BOINC's adaptive replication trusts a host after a run of consecutive valid results and replicates
its work rarely from then on; a refused result ends the run. Repeated refusals quarantine a host: a
broken or hostile machine stops receiving work instead of spending the job's error budget.
"""

from datetime import timedelta

QUARANTINE_FOR = timedelta(hours=24)  # then the host gets work again, on probation (not trusted)


def score(valid: int, failed: int) -> float:
    """The share of valid results, with one valid and one failed result assumed beforehand (Laplace's
    rule), so a new host starts at 0.5 and one result does not swing it to 0 or 1."""
    return (valid + 1) / (valid + failed + 2)


def trusted(consecutive_valid: int, trusted_after: int) -> bool:
    """Whether a host's work may go unreplicated (validation.trusted_after)."""
    return consecutive_valid >= trusted_after


def quarantine_reason(refused_in_a_row: int, last_reason: str, after: int | None) -> str | None:
    """Why a host is quarantined after `refused_in_a_row` refusals (not timeouts: volunteers' machines go
    away), the job refusing the last one quarantining after `after` (None: never), or None if it is not."""
    if after is None or refused_in_a_row < after:
        return None
    return f"{refused_in_a_row} results refused in a row; the last: {last_reason}"[:500]
