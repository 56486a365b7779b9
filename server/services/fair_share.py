"""Fair share between running jobs: how a host's free slots are split among the jobs it can run.

Each job's share of the running assignments follows its weight (`scheduling.weight`): a slot goes
to the job whose running assignments, counting that slot, are fewest per unit of weight (the
virtual finish time of weighted fair queueing). Two jobs of weight 1 get one slot in two; weights
2:1 get two in three. The state is the ledger's own: the count of each job's in-progress
assignments, read at each request, so several scheduler processes share it without any state of
their own, and a job that had no work to give (between epochs) gets no credit to catch up with.
Concurrent requests read the same counts and may tilt a few slots one way; the next requests
see them and tilt back.
"""

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.models import Assignment


def split_slots(slots: int, running: dict[int, int], weights: dict[int, float]) -> dict[int, int]:
    """Slots for each job of `weights` (job id -> weight > 0), given each one's `running` assignments:
    one at a time to the job with the least (running + given + 1) / weight, ties to the lower
    (older) job id. No I/O."""
    given = dict.fromkeys(weights, 0)
    for _ in range(slots if weights else 0):
        job = min(weights, key=lambda j: ((running.get(j, 0) + given[j] + 1) / weights[j], j))
        given[job] += 1
    return given


def running_assignments(s: Session, job_ids: list[int]) -> dict[int, int]:
    """Job id -> its in-progress assignments, for `job_ids`. One aggregate over the live assignments
    (the status index), skipped when there is no choice to make."""
    if len(job_ids) < 2:
        return {}
    rows = s.execute(
        select(Assignment.job_id, func.count())
        .where(Assignment.status == AssignmentStatus.in_progress.value, Assignment.job_id.in_(job_ids))
        .group_by(Assignment.job_id)
    ).all()
    return {job_id: n for job_id, n in rows}


def by_share(running: dict[int, int], weights: dict[int, float]) -> list[int]:
    """Job ids of `weights`, the furthest below its share first (ties: older first). No I/O."""
    return sorted(weights, key=lambda j: (running.get(j, 0) / weights[j], j))
