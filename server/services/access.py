"""What a host may read: the files its running assignments need, and the data of the DeDLOC
collaborations it has joined. Nothing else, whatever ids it names.

Each check answers "no" for an object that does not exist exactly as for one the host may not read,
so that a host cannot learn which ids exist by probing. Presigned object-storage URLs follow the same
rule by construction: dispatch issues them only for the shard and snapshot of the assignment it hands
out (crowdtrain.server.services.dispatch._Request._describe).
"""

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.models import Assignment, Shard, Workunit
from crowdtrain.server.services import dedloc_peers

_RUNNING = AssignmentStatus.in_progress.value


def is_collaboration_member(r: redis.Redis, job_id: int, host_id: int) -> bool:
    """Whether one of the host's peers has joined the DeDLOC job `job_id`
    (crowdtrain.server.services.dedloc_peers.join)."""
    return any(peer.host_id == host_id for peer in dedloc_peers.peers(r, job_id).values())


def readable_shard_key(db: sessionmaker[Session], r: redis.Redis, host_id: int, shard_id: int) -> str | None:
    """The storage key of shard `shard_id` if the host may read it, else None (also if it does not exist).

    Readable by a host with an in-progress assignment of a workunit on that shard (prefetched and
    resumed assignments are in progress too), and by members of the shard's job's DeDLOC collaboration.
    """
    with db.begin() as s:
        shard = s.execute(select(Shard.job_id, Shard.key).where(Shard.id == shard_id)).first()
        if shard is None:
            return None
        assigned = s.scalar(
            select(Assignment.id)
            .join(Workunit, Workunit.id == Assignment.workunit_id)
            .where(Assignment.host_id == host_id, Assignment.status == _RUNNING, Workunit.shard_id == shard_id)
            .limit(1)
        )
    if assigned is not None or is_collaboration_member(r, shard.job_id, host_id):
        return shard.key
    return None


def may_read_snapshot(db: sessionmaker[Session], host_id: int, job_id: int, version: int) -> bool:
    """Whether the host has an in-progress assignment of `job_id` whose base is snapshot `version`."""
    with db.begin() as s:
        return (
            s.scalar(
                select(Assignment.id)
                .where(
                    Assignment.host_id == host_id,
                    Assignment.job_id == job_id,
                    Assignment.base_version == version,
                    Assignment.status == _RUNNING,
                )
                .limit(1)
            )
            is not None
        )
