"""A DeDLOC job's rounds for the operator's job page: steps committed, members, mean round time, and
examples per step against the target batch. Read from the commit records (`keys.dedloc_commits`), the
round document and the live peers; nothing is written.

Why a step's examples exceed the target: peers report the examples they have accumulated every
`report_interval` seconds, and the step closes once the sum of the reports reaches
`target_batch_size` (crowdtrain.core.dedloc.step_is_full). The report that closes it overshoots by
whatever its peer accumulated since its last one, and the round's members then contribute what they
hold when each says it is ready (they go on accumulating through matchmaking): a committed step
averages over at least the target, usually more.
"""

from statistics import mean

import redis
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.schemas_dashboard import DedlocFigures, DedlocStep
from crowdtrain.server.services import dedloc_document, dedloc_jobs, dedloc_peers
from crowdtrain.server.services.clock import now_or_wall

RECENT_STEPS = 10


def committed_steps(commits: dict[int, dict]) -> list[DedlocStep]:
    """Each commit record as a step, oldest first, with the seconds since the previous one. No I/O."""
    steps, last_at = [], None
    for step in sorted(commits):
        c = commits[step]
        steps.append(
            DedlocStep(
                step=step,
                attempt=c["attempt"],
                members=len(c["members"]),
                examples=sum(c["examples"].values()),
                seconds=None if last_at is None else c["at"] - last_at,
            )
        )
        last_at = c["at"]
    return steps


def dedloc_figures(db: sessionmaker[Session], r: redis.Redis, job_id: int, now: float | None = None) -> DedlocFigures:
    """The job's rounds at `now` (Unix time, default the clock's); DedlocProblem if there is no such job
    (not found) or it runs in another mode (conflict)."""
    now = now_or_wall(now)
    view = dedloc_jobs.job_view(db, job_id)
    commits = dedloc_jobs.commits(r, job_id)
    rnd = dedloc_document.load(r, job_id)
    steps = committed_steps(commits)
    rounds = [s.seconds for s in steps if s.seconds is not None]
    examples = [s.examples for s in steps]
    target = view.spec.target_batch_size
    return DedlocFigures(
        job_id=job_id,
        phase="finished" if rnd is not None and rnd.finished else (rnd.phase if rnd is not None else "preparing"),
        step=rnd.step if rnd is not None else 0,
        steps_committed=len(steps),
        max_steps=view.max_steps,
        peers_live=len(dedloc_peers.live_peers(r, job_id, view.spec, now)),
        members_last=steps[-1].members if steps else None,
        members_seen=len({m for c in commits.values() for m in c["members"]}),
        mean_round_seconds=mean(rounds) if rounds else None,
        target_batch_size=target,
        examples_per_step=mean(examples) if examples else None,
        examples_min=min(examples, default=None),
        examples_max=max(examples, default=None),
        overshoot=mean(n - target for n in examples) if examples else None,
        recent=steps[::-1][:RECENT_STEPS],
    )
