"""Replicated workunits: how many hosts train one, handing out the replicas, and recording the
validator's verdict (crowdtrain.assimilator.validator).

A workunit's `quorum` is set when a host first claims it (`quorum_for`): 2 when the job replicates
that host's work (a host not yet trusted, or a spot check), else 1. While it has fewer live replicas
(in progress or uploaded) than its quorum and no verdict, other hosts may claim a replica
(`claim_replicas`): never a host that holds a live replica of it, nor one of the same volunteer
account or the same network prefix (crowdtrain.core.addresses) as a live holder, so that no host,
account or network votes twice; a host whose network is unknown ("") counts as a network of its
own. The hosts of an inconclusive vote may hold replicas of the next one: its replicas all ended
with it, and a workunit that only hosts of past votes may replicate would otherwise wait for a new
host forever. Its uploaded results wait
until `quorum` of them are in; the verdict then ends each one (`record_verdict`): the canonical
replica goes on to be merged, the others that agree end `validated` (valid and credited, not
merged), the rest `rejected`. A workunit is judged once: the verdict is recorded under the
workunit's lock, and a second judgement finds it there. A vote that waits for a replica no host
comes for (every other account's hosts quarantined, or none left) is closed by the transitioner
(`close_stalled_votes`), inconclusive, so that its epoch never waits forever.
"""

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session, aliased, sessionmaker

from crowdtrain.core import reputation
from crowdtrain.core.credit import result_credit
from crowdtrain.core.jobspec import scheduling_of
from crowdtrain.core.logs import ids
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.core.validationspec import ValidationSpec, validation_of
from crowdtrain.server.ledger import reputation as host_record
from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.models import Assignment, Host, Job, Shard, Workunit, utcnow

log = logging.getLogger(__name__)

LIVE = (AssignmentStatus.in_progress.value, AssignmentStatus.uploaded.value)


def replicated_host(host: Host, spec: ValidationSpec) -> bool:
    """Whether the job replicates all of this host's work: it is not trusted yet, and the job says so."""
    return spec.replicate_untrusted and not reputation.trusted(host.consecutive_valid, spec.trusted_after)


def quorum_for(host: Host, spec: ValidationSpec, rng: random.Random | None = None) -> int:
    """The quorum of a workunit `host` claims first: replicated for a host not yet trusted (when the
    job replicates those) and for a `replication` share of the others' work."""
    if replicated_host(host, spec):
        return 2
    if spec.replication > 0 and (rng or random).random() < spec.replication:
        return 2
    return 1


def claim_replicas(s: Session, job: Job, host: Host, limit: int) -> list[tuple[Workunit, Shard]]:
    """Lock up to `limit` workunits of `job` that want another replica and that `host` may take, oldest
    epoch first. Locked with SKIP LOCKED like any claim, then counted again once locked (another
    scheduler may have committed a replica since the first query's snapshot)."""
    other = aliased(Assignment)
    live = (
        select(func.count())
        .where(other.workunit_id == Workunit.id, other.status.in_(LIVE))
        .correlate(Workunit)
        .scalar_subquery()
    )
    holds_it = exists().where(other.workunit_id == Workunit.id, other.host_id == host.id, other.status.in_(LIVE))
    query = (
        select(Workunit)
        .where(
            Workunit.job_id == job.id,
            Workunit.status == WorkunitStatus.in_progress.value,
            Workunit.quorum > 1,
            Workunit.canonical_assignment_id.is_(None),
            live < Workunit.quorum,
            ~holds_it,
        )
        .order_by(Workunit.epoch, Workunit.id)
        .limit(limit)
        .with_for_update(of=Workunit, skip_locked=True)
    )
    if host.account:
        holder = aliased(Host)
        same_account = exists().where(
            other.workunit_id == Workunit.id,
            other.status.in_(LIVE),
            other.host_id == holder.id,
            holder.account == host.account,
        )
        query = query.where(~same_account)
    if host.network:
        holder = aliased(Host)
        same_network = exists().where(
            other.workunit_id == Workunit.id,
            other.status.in_(LIVE),
            other.host_id == holder.id,
            holder.network == host.network,
        )
        query = query.where(~same_network)
    candidates = s.scalars(query).all()
    if not candidates:
        return []
    counts = dict(
        s.execute(
            select(Assignment.workunit_id, func.count())
            .where(Assignment.workunit_id.in_([wu.id for wu in candidates]), Assignment.status.in_(LIVE))
            .group_by(Assignment.workunit_id)
        ).all()
    )
    claimed = [wu for wu in candidates if counts.get(wu.id, 0) < wu.quorum and wu.canonical_assignment_id is None]
    shards = {sh.id: sh for sh in s.scalars(select(Shard).where(Shard.id.in_({wu.shard_id for wu in claimed})))}
    return [(wu, shards[wu.shard_id]) for wu in claimed]


@dataclass(frozen=True)
class Upload:
    """An uploaded replica, as the validator measures it."""

    assignment_id: int
    base_version: int
    upload_key: str


def uploads(db: sessionmaker[Session], workunit_id: int) -> list[Upload]:
    """The workunit's uploaded results, by assignment id."""
    with db.begin() as s:
        rows = s.execute(
            select(Assignment.id, Assignment.base_version, Assignment.upload_key)
            .where(Assignment.workunit_id == workunit_id, Assignment.status == AssignmentStatus.uploaded.value)
            .order_by(Assignment.id)
        ).all()
    return [Upload(aid, base, key) for aid, base, key in rows if key is not None]


def shard_key(db: sessionmaker[Session], workunit_id: int) -> str:
    """The object key of the shard the workunit's replicas were trained on."""
    with db.begin() as s:
        return s.scalars(
            select(Shard.key).join(Workunit, Workunit.shard_id == Shard.id).where(Workunit.id == workunit_id)
        ).one()


@dataclass(frozen=True)
class Recorded:
    """What the ledger holds once a verdict is recorded (or found recorded)."""

    canonical: int | None  # the replica to merge; None: no decision (awaiting) or inconclusive
    decided: bool
    ended: list[str]  # upload keys of replicas ended by this call, to delete
    failed_workunit: bool = False  # inconclusive at max_errors: the workunit failed for good


def record_verdict(
    db: sessionmaker[Session],
    workunit_id: int,
    judged: list[int],
    canonical: int | None,
    more: bool,
    invalid: dict[int, str],
    charged: frozenset[int],
    max_replicas: int,
) -> Recorded:
    """Apply the validator's verdict on the `judged` uploaded replicas of a workunit, once.

    Lock order as everywhere: assignments (by id) -> hosts (by id) -> workunit -> job. A verdict
    already recorded is returned as it is; one judged on other replicas than those now uploaded is
    not applied (a later upload's merge judges again)."""
    with db.begin() as s:
        replicas = s.scalars(
            select(Assignment)
            .where(Assignment.workunit_id == workunit_id, Assignment.status == AssignmentStatus.uploaded.value)
            .order_by(Assignment.id)
            .with_for_update()
        ).all()
        hosts = {
            h.id: h
            for h in s.scalars(
                select(Host).where(Host.id.in_({a.host_id for a in replicas})).order_by(Host.id).with_for_update()
            )
        }
        wu = s.get_one(Workunit, workunit_id, with_for_update=True)
        if wu.canonical_assignment_id is not None:
            return Recorded(wu.canonical_assignment_id, True, [])
        if wu.status != WorkunitStatus.in_progress.value or sorted(a.id for a in replicas) != sorted(judged):
            return Recorded(None, False, [])
        if more:
            wu.quorum = min(max(wu.quorum, len(replicas) + 1), max_replicas)
            log.info(
                "workunit %s: replicas %s do not agree; asking for replica %d",
                wu.id,
                judged,
                wu.quorum,
                extra=ids(job_id=wu.job_id, workunit_id=wu.id),
            )
            return Recorded(None, False, [])
        job = s.get_one(Job, wu.job_id)
        now = utcnow()
        ended = []
        for a in replicas:
            host = hosts[a.host_id]
            if a.id in invalid:
                states.move(a, AssignmentStatus.rejected)
                a.message = f"refused by replica validation: {invalid[a.id]}"[:1000]
                if a.id in charged:
                    host_record.count_failure(host, job, AssignmentStatus.rejected, a.message)
            elif a.id != canonical:
                states.move(a, AssignmentStatus.validated)
                a.message = f"agrees with replica {canonical}, which was merged"
                host_record.count_valid(host, (now - a.sent_at).total_seconds())
                grant_credit(s, a, host, job, wu)
            else:
                continue
            a.finished_at = now
            if a.upload_key:
                ended.append(a.upload_key)
            log.info(
                "assignment %s: %s (%s)",
                a.id,
                a.status,
                a.message,
                extra=ids(job_id=a.job_id, workunit_id=wu.id, assignment_id=a.id, host_id=a.host_id),
            )
        if canonical is not None:
            wu.canonical_assignment_id = canonical
            return Recorded(canonical, True, ended)
        # Inconclusive: trained again from scratch, as after any failure.
        wu.error_count += 1
        failed = wu.error_count >= job.spec["scheduling"]["max_errors"]
        states.move(wu, WorkunitStatus.failed if failed else WorkunitStatus.ready)
        if failed:
            wu.finished_at = now
        return Recorded(None, True, ended, failed_workunit=failed)


def grant_credit(s: Session, a: Assignment, host: Host, job: Job, wu: Workunit) -> None:
    """A valid result's credit (crowdtrain.core.credit): the training it was asked for."""
    a.credit = result_credit(
        s.get_one(Shard, wu.shard_id).examples,
        job.spec["training"]["local_epochs"],
        a.local_fraction,
        job.training_flops,
    )
    host.credit += a.credit


def replica_wait(job_spec: dict) -> float:
    """Seconds a vote waits for another replica before it closes inconclusive: the job's
    validation.replica_wait_seconds, else its scheduling.deadline_seconds."""
    return validation_of(job_spec).replica_wait_seconds or scheduling_of(job_spec).deadline_seconds


@dataclass(frozen=True)
class StalledVote:
    """A vote closed inconclusive for want of a replica: its workunit, and what became of it."""

    job_id: int
    epoch: int
    workunit_id: int
    failed: bool  # at max_errors: the workunit failed for good, and its epoch may close
    ended: list[str]  # upload keys of the results refused with it, to delete
    message: str


def _waiting_votes(s: Session) -> list[int]:
    """Replicated workunits of running jobs whose uploaded results wait for a replica that no host holds."""
    a = aliased(Assignment)

    def count(status: AssignmentStatus):
        return (
            select(func.count())
            .where(a.workunit_id == Workunit.id, a.status == status.value)
            .correlate(Workunit)
            .scalar_subquery()
        )

    uploaded, running = count(AssignmentStatus.uploaded), count(AssignmentStatus.in_progress)
    return list(
        s.scalars(
            select(Workunit.id)
            .join(Job, Job.id == Workunit.job_id)
            .where(
                Job.status == JobStatus.running.value,
                Workunit.status == WorkunitStatus.in_progress.value,
                Workunit.quorum > 1,
                Workunit.canonical_assignment_id.is_(None),
                running == 0,
                uploaded > 0,
                uploaded < Workunit.quorum,
            )
            .order_by(Workunit.id)
            .limit(500)
        )
    )


def close_stalled_votes(db: sessionmaker[Session], now: datetime | None = None) -> list[StalledVote]:
    """Close, inconclusive, every vote whose results have waited `replica_wait` seconds for another
    replica with none sent: its uploaded results are refused, uncharged (nothing was found wrong
    with them) and uncredited, and the workunit counts an error and is trained again, or fails at
    the job's max_errors, as after any inconclusive vote. One transaction per workunit, each checked
    again under the lock order of `record_verdict`, so a replica claimed or uploaded meanwhile wins."""
    now = now or utcnow()
    with db.begin() as s:
        candidates = _waiting_votes(s)
    return [vote for wu_id in candidates if (vote := _close_if_stalled(db, wu_id, now)) is not None]


def _close_if_stalled(db: sessionmaker[Session], workunit_id: int, now: datetime) -> StalledVote | None:
    with db.begin() as s:
        replicas = s.scalars(
            select(Assignment).where(Assignment.workunit_id == workunit_id).order_by(Assignment.id).with_for_update()
        ).all()
        wu = s.get_one(Workunit, workunit_id, with_for_update=True)
        job = s.get_one(Job, wu.job_id)
        uploaded = [a for a in replicas if a.status == AssignmentStatus.uploaded.value]
        running = any(a.status == AssignmentStatus.in_progress.value for a in replicas)
        if (
            job.status != JobStatus.running.value
            or wu.status != WorkunitStatus.in_progress.value
            or wu.canonical_assignment_id is not None
            or running
            or not uploaded
            or len(uploaded) >= wu.quorum
        ):
            return None
        wait = replica_wait(job.spec)
        last = max(max(a.sent_at, a.uploaded_at or a.sent_at) for a in replicas)
        if now - last < timedelta(seconds=wait):
            return None
        max_errors = job.spec["scheduling"]["max_errors"]
        wu.error_count += 1
        failed = wu.error_count >= max_errors
        message = (
            f"replica vote closed inconclusive: {len(uploaded)} of {wu.quorum} replicas uploaded and no host took "
            f"another in {wait:.0f} s (a replica goes to a host without one, of another volunteer account and "
            f"network, not quarantined); the workunit {'failed' if failed else 'is trained again'} "
            f"(error {wu.error_count} of max_errors={max_errors})"
        )
        for a in uploaded:
            states.move(a, AssignmentStatus.rejected)
            a.message, a.finished_at = message, now
        states.move(wu, WorkunitStatus.failed if failed else WorkunitStatus.ready)
        if failed:
            wu.finished_at = now
        log.warning("workunit %s: %s", wu.id, message, extra=ids(job_id=wu.job_id, workunit_id=wu.id))
        ended = [a.upload_key for a in uploaded if a.upload_key]
        return StalledVote(wu.job_id, wu.epoch, wu.id, failed, ended, message)
