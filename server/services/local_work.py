"""Dynamic local work (Async Local-SGD's dynamic local updates): a host trains a share of the
recipe's local epochs in proportion to its measured speed, so that a slow host's update reaches the
parameter servers about as soon, and so about as stale, as a fast host's.

Speed is examples trained per second of training, as hosts report with their uploads (ResultMetrics),
measured per job (one model's speed says little about another's) over the job's recent uploads.
A host reports its own figures: the examples are bounded by what the assignment asked for, and the
reference is a high quantile of the hosts' speeds, so that one host claiming an absurd speed among
many does not shrink the others' work (and `min_local_fraction` bounds what it can do among few).
"""

from collections import defaultdict
from collections.abc import Iterable

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from crowdtrain.server.ledger.models import Assignment, Job, Shard, Workunit

WINDOW = 200  # the job's most recent uploads that speeds are measured over
REFERENCE_QUANTILE = 0.9  # of the hosts' speeds: the speed that trains the full local epochs


def host_speeds(uploads: Iterable[tuple[int, int, float]]) -> dict[int, float]:
    """Examples per second of each host, from (host id, examples, seconds) of its uploads:
    total examples over total seconds. Uploads without positive seconds are skipped. No I/O."""
    examples: dict[int, float] = defaultdict(float)
    seconds: dict[int, float] = defaultdict(float)
    for host_id, n, t in uploads:
        if t > 0 and n >= 0:
            examples[host_id] += n
            seconds[host_id] += t
    return {h: examples[h] / seconds[h] for h in seconds}


def local_fraction(host_speed: float | None, speeds: Iterable[float], min_fraction: float) -> float:
    """The share of the local epochs for a host of `host_speed` among hosts of `speeds`: its speed
    over the REFERENCE_QUANTILE of `speeds`, clipped to [min_fraction, 1]. A host never measured
    (None), or a job with no measured host, gets 1. No I/O."""
    measured = [v for v in speeds if v > 0]
    if host_speed is None or not measured:
        return 1.0
    reference = float(np.quantile(measured, REFERENCE_QUANTILE))
    return float(min(1.0, max(min_fraction, host_speed / reference)))


def recent_speeds(s: Session, job_id: int, local_epochs: int) -> dict[int, float]:
    """Each host's speed on the job over its last WINDOW uploads (see `host_speeds`); a host's
    reported examples count for no more than its shard's examples times `local_epochs`."""
    rows = s.execute(
        select(Assignment.host_id, Assignment.examples, Assignment.train_seconds, Shard.examples)
        .join(Workunit, Workunit.id == Assignment.workunit_id)
        .join(Shard, Shard.id == Workunit.shard_id)
        .where(
            Assignment.job_id == job_id,
            Assignment.uploaded_at.is_not(None),
            Assignment.examples.is_not(None),
            Assignment.train_seconds > 0,
        )
        .order_by(Assignment.id.desc())
        .limit(WINDOW)
    ).all()
    reports = []
    for host, n, t, shard_examples in rows:
        assert n is not None and t is not None  # the query selects reported figures only
        reports.append((host, min(n, shard_examples * local_epochs), t))
    return host_speeds(reports)


def fraction_for(s: Session, job: Job, host_id: int) -> float:
    """The local fraction of the host's next assignments of `job`: 1 unless the job asks for
    `training.dynamic_local_work`."""
    training = job.spec["training"]
    if not training.get("dynamic_local_work"):
        return 1.0
    speeds = recent_speeds(s, job.id, training["local_epochs"])
    return local_fraction(speeds.get(host_id), speeds.values(), training["min_local_fraction"])
