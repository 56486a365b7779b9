"""Backpressure: each job's in-flight budget, the most of its assignments that may be dispatched or
uploaded but not yet merged (prefetched ones included). At its budget a job gets no new workunit from
dispatch (crowdtrain.server.services.dispatch), which serves other jobs instead, until merges land:
results then never queue for the parameter servers faster than they merge them, which is what kept
staleness growing over epochs when merging and evaluation were slower than training.

The budget is `scheduling.max_in_flight` when the spec sets it; otherwise it is derived from the job's
merge pace (crowdtrain.server.ledger.pace, measured over the latest merges when each is recorded):

    budget = max(rule floor, ceil(merge rate x turnaround) + hosts)

- merge rate x turnaround (Little's law) is how many results the parameter servers merge while one
  assignment is out with its host: enough in flight to keep them busy with none waiting;
- hosts: one more assignment for each host holding the job's work (and for the asking host, when it
  holds none): each host can always hold one beyond the merge pipeline, its prefetch or its first
  task. While the servers keep up, the rate is the hosts' supply, merge rate x turnaround the slots
  training, and the budget is what the clients hold (a slot each, and one prefetched per host): it
  does not bind, and it grows as they take more, the rate following the in-flight count up. When
  the servers are the bottleneck the rate is their capacity, and results wait at most about one per
  host for their merge, so staleness stays near merge rate x turnaround + hosts instead of growing;
- rule floor: fedbuff combines `assimilation.buffer_size` results per step, so never fewer than that;
  any other rule 1.

A job in semi-synchronous rounds (`scheduling.rounds`, crowdtrain.core.rounds) has no derived budget:
at most one round's results are unmerged or waiting in the rule's buffer, so its budget is what is
left of the current round, and the next round opens when the last result of this one is merged.

Before two merges are recorded there is no pace to derive it from, and no derived budget: dispatch
gives as before (at most the current epoch and the next, released early) until the first merges
measure it. Requests on PostgreSQL that run at the same moment each see the count before the
others' claims, so together they may pass the budget by what they claim at once; the next requests
see it and hold back. Each scheduler process keeps the counts up to a second, or until W_s moves, and
adds its own claims (crowdtrain.server.services.in_flight_counts): the other processes' claims of that
second may pass the budget too. Replicas for validation and straggler duplicates at an epoch's tail are not
held: they finish workunits already in flight (a vote waits on its replicas, and its first results
count against the budget; a dead host's workunit would wait for its deadline).
No I/O in this module.
"""

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, func, select

from crowdtrain.core import rounds
from crowdtrain.core.assimilationspec import buffer_size_of
from crowdtrain.core.jobspec import scheduling_of
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.models import Assignment, Host, Job

MAX_BUDGET = 1_000_000  # as scheduling.max_in_flight's bound
MIN_RETRY_SECONDS = 0.1  # the shortest wait a held host is told (`retry_after`)
# In flight: dispatched (training, or prefetched and waiting on its host) or uploaded, not yet merged.
UNMERGED = (AssignmentStatus.in_progress.value, AssignmentStatus.uploaded.value)


@dataclass(frozen=True)
class BudgetTerms:
    """What a job's budget depends on that its spec fixes."""

    max_in_flight: int | None  # scheduling.max_in_flight: the budget, when set
    rule_floor: int  # the fewest results in flight the merge rule needs: fedbuff's buffer, else 1
    round_size: int | None = None  # scheduling.rounds: the results of a round (crowdtrain.core.rounds)

    @classmethod
    def of(cls, spec: dict[str, Any]) -> "BudgetTerms":
        return cls(
            max_in_flight=scheduling_of(spec).max_in_flight,
            rule_floor=buffer_size_of(spec),
            round_size=rounds.round_size(spec),
        )


def in_flight_budget(
    terms: BudgetTerms,
    merge_rate: float | None,
    turnaround_seconds: float | None,
    hosts: int,
    version: int = 0,
) -> int | None:
    """The job's budget: in rounds what is left of the round at W_s `version` (the newest recorded
    merged; crowdtrain.core.rounds.budget), else `max_in_flight` if set, else derived (see the module
    docstring) from its measured pace and the `hosts` holding its work; None (no budget) while it
    has no pace. Never 0."""
    if terms.round_size is not None:
        return rounds.budget(terms.round_size, version)
    if terms.max_in_flight is not None:
        return terms.max_in_flight
    if merge_rate is None or turnaround_seconds is None:
        return None
    return max(terms.rule_floor, 1, min(MAX_BUDGET, math.ceil(merge_rate * turnaround_seconds) + hosts))


def held_seconds(merge_rate: float | None, hosts: int) -> float | None:
    """hosts / merge rate: the time the parameter servers take to merge one result for each of
    `hosts` (those holding a job's work, or waiting for it); None without a measured rate."""
    return hosts / merge_rate if merge_rate and merge_rate > 0 else None


def held_wait(held: float | None, fastest_rate: float | None, waiting: int) -> float | None:
    """What a held host waits before `retry_after` bounds it: `held` (the soonest job's hosts holding
    its work / its merge rate), or longer when more hosts are waiting (`waiting`, those held lately:
    crowdtrain.server.services.held_hosts) than hold work: waiting / the fastest merge rate of the jobs
    that held it, so that all waiting hosts' requests together still come about as often as merges
    make room. None when no job with a measured pace held it."""
    if held is None:
        return None
    return max(held, held_seconds(fastest_rate, waiting) or 0.0)


def retry_after(held: float | None, longest: float) -> float:
    """How long a host that jobs' budgets held back (and that got nothing else) waits before asking
    again: `held` (held_seconds of those jobs, the soonest), so that the waiting hosts' requests
    together come about as often as merges make room; at least MIN_RETRY_SECONDS, at most `longest`
    (the scheduler's work_retry_after, what a host is told when nothing is ready at all, and when no
    pace is measured). A fixed 2 s was many workunits' time on a task of short workunits: held hosts
    slept through most of the room the merges made."""
    if held is None:
        return longest
    return min(longest, max(MIN_RETRY_SECONDS, held))


def in_flight_columns() -> tuple[ColumnElement[int], ...]:
    """For a statement over jobs and hosts (dispatch's first): how many of the job's unmerged
    assignments the host holds, counted beside the job's row (an index range scan over the host's
    assignments). The job's own counts are kept per process (crowdtrain.server.services.in_flight_counts):
    counted on every request, their cost grew with the work out. Builds the expression; runs nothing."""
    unmerged = and_(Assignment.job_id == Job.id, Assignment.status.in_(UNMERGED))
    return (
        select(func.count())
        .where(unmerged, Assignment.host_id == Host.id)
        .correlate(Job, Host)
        .scalar_subquery()
        .label("job_held_by_host"),
    )
