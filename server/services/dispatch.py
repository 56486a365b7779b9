"""Handing workunits to hosts: atomic claims, fair share between jobs, locality, reliability, early
epoch release, straggler duplicates at an epoch's tail, and the share of the local epochs each host
trains (dynamic local work, crowdtrain.server.services.local_work).

A work request is the scheduler's most frequent call, so its common case is kept lean: one
transaction on one connection, plain SQL statements (the host's row with the running jobs' live
columns, one claim statement per preference, the claimed shards, one insert of the assignments),
no ORM object, and what never changes in a job after submission (its spec parsed, its recipe,
which frameworks run it) read once per process (crowdtrain.server.services.job_terms). The rarer paths — an
epoch's release, straggler duplicates, replicas for validation, a re-dealt epoch's shards — load
the ORM rows they need and run the ledger's procedures in the same transaction. The first statement,
the host's row with the jobs' live columns, and what is noted of the host are
crowdtrain.server.services.dispatch_host's.

A job at its in-flight budget (crowdtrain.server.services.backpressure) gets no new workunit; its
unmerged assignments are counted in the request's first statement.
"""

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, Engine, Row, select, update
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.logs import ids
from crowdtrain.core.refusals import RefusalKind
from crowdtrain.core.schemas import AssignmentOut, FileRef, Resources, SignedRecipe, WorkRequest
from crowdtrain.core.storage import Storage
from crowdtrain.server.ledger import replicas, reputation
from crowdtrain.server.ledger.claims import RELIABLE_AFTER, Claim, claim_workunits, open_assignments
from crowdtrain.server.ledger.duplicates import claim_straggler_duplicates
from crowdtrain.server.ledger.epochs import release_next_epoch_early
from crowdtrain.server.ledger.models import Host, Job, Shard, Workunit, utcnow
from crowdtrain.server.services import dispatch_host, fair_share, file_refs, local_work
from crowdtrain.server.services.backpressure import MAX_BUDGET, held_seconds, in_flight_budget
from crowdtrain.server.services.hosts import NotAuthorized, hash_token
from crowdtrain.server.services.in_flight_counts import InFlightCounts
from crowdtrain.server.services.job_terms import JobTerms, LiveJob, TermsCache
from crowdtrain.workgen.generator import write_epoch_shards

log = logging.getLogger(__name__)

_terms = TermsCache()
_in_flight = InFlightCounts()


def request_work(
    db: sessionmaker[Session],
    storage: Storage,
    host_id: int,
    free_slots: int,
    cached: list[str],
    resources: Resources | None,
    presign_seconds: int = 900,
    refused_jobs: frozenset[int] = frozenset(),
) -> list[AssignmentOut]:
    """Give the host `host_id` up to `free_slots` assignments (see `serve_work`)."""
    with _engine(db).begin() as c:
        rows = c.execute(dispatch_host.HOST_BY_ID, {"seen_host": host_id}).all()
        return _dispatch(c, storage, rows, free_slots, cached, resources, presign_seconds, refused_jobs).given


def serve_work(
    db: sessionmaker[Session],
    storage: Storage,
    token: str,
    read_request: Callable[[], WorkRequest],
    presign_seconds: int = 900,
    before_commit: Callable[[WorkRequest, list[AssignmentOut]], None] | None = None,
) -> tuple[WorkRequest, "Served"]:
    """Authenticate the host by its bearer `token` (NotAuthorized if it is no live host's), then read
    its request (`read_request`, which may refuse it) and give it up to `free_slots` assignments, all
    in one transaction: ready workunits of the jobs it can run and has not refused (their recipe
    unsigned or signed by a key the host does not trust), split by fair share
    (crowdtrain.server.services.fair_share); then, for slots no job can fill, duplicates of
    stragglers (crowdtrain.server.ledger.duplicates). Replicas that jobs validating their results want
    come first (crowdtrain.server.ledger.replicas). No workunit is ever held by two hosts at once,
    except a straggler's and its one duplicate, and a replicated workunit's replicas. A quarantined
    host gets nothing. `before_commit` sees what is given before it is committed, and may still undo
    it all by raising."""
    with _engine(db).begin() as c:
        rows = c.execute(dispatch_host.HOST_BY_TOKEN, {"token_hash": hash_token(token)}).all()
        if not rows or rows[0].revoked:
            raise NotAuthorized("unknown or revoked host token", RefusalKind.unauthenticated)
        req = read_request()
        served = _dispatch(
            c,
            storage,
            rows,
            req.free_slots,
            req.cached_shards,
            req.resources,
            presign_seconds,
            frozenset(req.refused_jobs),
        )
        if before_commit is not None:
            before_commit(req, served.given)
        return req, served


@dataclass(frozen=True)
class Served:
    """A work request's answer: the assignments given, and when nothing was given because jobs were
    at their in-flight budget, the seconds until their merges make room for the waiting hosts
    (hosts / merge rate, the shortest over those jobs; backpressure.retry_after bounds it)."""

    given: list[AssignmentOut]
    held_seconds: float | None = None
    held_rate: float | None = None  # the fastest merge rate of the jobs that held it back
    host_id: int | None = None  # the host held back, when it was


def _engine(db: sessionmaker[Session]) -> Engine:
    engine = db.kw["bind"]
    assert isinstance(engine, Engine)
    return engine


def _dispatch(
    c: Connection,
    storage: Storage,
    rows: Sequence[Row],
    free_slots: int,
    cached: list[str],
    resources: Resources | None,
    presign_seconds: int,
    refused_jobs: frozenset[int],
) -> Served:
    """Serve the host of `rows` (crowdtrain.server.services.dispatch_host.host_and_live_jobs)."""
    host = rows[0]
    host_frameworks = dispatch_host.note_host(c, host, resources)
    if free_slots == 0 or reputation.quarantined(host.quarantined_until):
        return Served([])
    live = {job_id: job for job_id, job in dispatch_host.live_jobs(rows).items() if job_id not in refused_jobs}
    terms = {j: t for j, t in _terms.of(c, live).items() if t.runs_on(host_frameworks)}
    if not terms:
        return Served([])
    live |= _in_flight.of(c, {j: live[j] for j in terms})
    with _Request(c, storage, host, live, terms, presign_seconds) as request:
        request.fill(free_slots, cached)
        if request.out:
            for job_id, given in Counter(a.job_id for a in request.out).items():
                _in_flight.claimed(c, live[job_id], given)
            return Served(request.out)
        held = request.held_seconds()
        return Served([], held, request.held_rate(), host.id) if held is not None else Served([])


def _hosts_for(live: LiveJob) -> int:
    """The hosts holding the job's work, this one counted when it holds none."""
    return live.in_flight_hosts + (0 if live.held_by_host else 1)


def _budget_for(t: JobTerms, live: LiveJob) -> int:
    """The job's in-flight budget for this host (its first assignment of the job raises a derived
    budget by one), or MAX_BUDGET while it has none."""
    budget = in_flight_budget(t.budget, live.merge_rate, live.turnaround_seconds, _hosts_for(live), live.param_version)
    return MAX_BUDGET if budget is None else budget


def _set_quorum(c: Connection, claimed: list[Claim], quorum: int) -> None:
    c.execute(update(Workunit).where(Workunit.id.in_([cl.workunit_id for cl in claimed])).values(quorum=quorum))


class _Request:
    """One work request's answer as it is built on the connection `c`, in its transaction; the rarer
    paths get an ORM session joined to that transaction, and the rows they need loaded once."""

    def __init__(
        self,
        c: Connection,
        storage: Storage,
        host: Row,
        live: Mapping[int, LiveJob],
        terms: Mapping[int, JobTerms],
        presign_seconds: int,
    ):
        self.c, self.storage, self.host, self.live, self.terms = c, storage, host, live, terms
        self.presign_seconds = presign_seconds
        self.out: list[AssignmentOut] = []
        self._session: Session | None = None
        self._jobs: dict[int, Job] = {}
        self._host: Host | None = None
        # Assignments each job may still open before it is at its in-flight budget.
        self.headroom = {j: _budget_for(t, live[j]) - live[j].in_flight for j, t in terms.items()}

    def __enter__(self) -> "_Request":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._session is not None:
            if exc[0] is None:
                self._session.flush()  # the connection's transaction commits it with the rest
            self._session.close()

    def held_seconds(self) -> float | None:
        """For a request given nothing: hosts / merge rate of the jobs at their budget (the soonest),
        or None when no job held it back (nothing was ready)."""
        at_budget = [self.live[j] for j, room in self.headroom.items() if room <= 0]
        held = [held_seconds(live.merge_rate, _hosts_for(live)) for live in at_budget]
        return min((s for s in held if s is not None), default=None)

    def held_rate(self) -> float | None:
        """The fastest measured merge rate of the jobs at their budget; None when none has one."""
        rates = [self.live[j].merge_rate for j, room in self.headroom.items() if room <= 0]
        return max((rate for rate in rates if rate), default=None)

    @property
    def s(self) -> Session:
        if self._session is None:
            self._session = Session(bind=self.c, expire_on_commit=False)
        return self._session

    def fill(self, free_slots: int, cached: list[str]) -> None:
        """Replicas first, then ready workunits split by fair share, then straggler duplicates."""
        running = fair_share.running_assignments(self.s, list(self.terms)) if len(self.terms) > 1 else {}
        self._fill_replicas(free_slots)
        self._fill_ready(free_slots, cached, running)
        self._fill_duplicates(free_slots, running)

    def _fill_replicas(self, free_slots: int) -> None:
        for job_id, t in self.terms.items():
            if t.validation.enabled and len(self.out) < free_slots:
                wanted = replicas.claim_replicas(self.s, self.job(job_id), self.host_row(), free_slots - len(self.out))
                self.open(job_id, [Claim.of(wu, sh) for wu, sh in wanted], "replica, ")

    def _fill_ready(self, free_slots: int, cached: list[str], running: dict[int, int]) -> None:
        """Ready workunits, the free slots split between the jobs by fair share (`running` counts each
        job's assignments, these included); a job at its in-flight budget waits."""
        reliable = self.host.consecutive_valid >= RELIABLE_AFTER
        weights = {j: t.scheduling.weight for j, t in self.terms.items()}
        open_jobs = {j: w for j, w in weights.items() if self.headroom[j] > 0}
        while len(self.out) < free_slots and open_jobs:
            plan = fair_share.split_slots(free_slots - len(self.out), running, open_jobs)
            for job_id, n in plan.items():
                if n == 0:
                    continue
                claimed = self._claim_ready(job_id, min(n, self.headroom[job_id]), reliable, cached)
                if claimed:
                    running[job_id] = running.get(job_id, 0) + len(claimed)
                    self.open(job_id, claimed)
                if len(claimed) < n:
                    del open_jobs[job_id]

    def _claim_ready(self, job_id: int, allowed: int, reliable: bool, cached: list[str]) -> list[Claim]:
        """Up to `allowed` ready workunits of the job, from a newer epoch too when the one this request
        saw runs short; with their replica quorum set when the job replicates."""
        claimed = claim_workunits(self.c, job_id, reliable, allowed, cached)
        if len(claimed) < allowed and self.newer_epoch(job_id):
            claimed += claim_workunits(self.c, job_id, reliable, allowed - len(claimed), cached)
        validation = self.terms[job_id].validation
        if claimed and validation.enabled:
            _set_quorum(self.c, claimed, replicas.quorum_for(self.host_row(), validation))
        return claimed

    def _fill_duplicates(self, free_slots: int, running: dict[int, int]) -> None:
        """Slots left over: no job has anything ready, even in an early-released epoch. A host whose
        work the job replicates gets no duplicate (its result would be merged unchecked)."""
        weights = {j: t.scheduling.weight for j, t in self.terms.items()}
        for job_id in fair_share.by_share(running, weights):
            after = self.terms[job_id].scheduling.duplicate_after_seconds
            if len(self.out) >= free_slots or after is None:
                continue
            if replicas.replicated_host(self.host_row(), self.terms[job_id].validation):
                continue
            duplicates = claim_straggler_duplicates(
                self.s, self.job(job_id), self.host_row(), free_slots - len(self.out), after
            )
            self.open(job_id, [Claim.of(wu, sh) for wu, sh in duplicates], "duplicate of a straggler, ")

    def job(self, job_id: int) -> Job:
        if job_id not in self._jobs:
            self._jobs[job_id] = self.s.get_one(Job, job_id)
        return self._jobs[job_id]

    def newer_epoch(self, job_id: int) -> bool:
        """For a claim that came up short: whether a newer epoch than the one this request first saw
        is now there to claim from, released by another request meanwhile or by this one
        (crowdtrain.server.ledger.epochs.release_next_epoch_early)."""
        job = self.job(job_id)
        return job.current_epoch > self.live[job_id].current_epoch or release_next_epoch_early(self.s, job)

    def host_row(self) -> Host:
        if self._host is None:
            self._host = self.s.get_one(Host, self.host.id)
        return self._host

    def open(self, job_id: int, claimed: list[Claim], kind: str = "") -> None:
        """Open the assignments of the claimed workunits (or straggler duplicates, or replicas: `kind`
        says which in the log) and describe them."""
        if not claimed:
            return
        if any(cl.shard_sha256 is None for cl in claimed):
            claimed = self._write_unwritten_shards(job_id, claimed)
        live, t = self.live[job_id], self.terms[job_id]
        fraction = (
            local_work.fraction_for(self.s, self.job(job_id), self.host.id)
            if t.spec["training"].get("dynamic_local_work")
            else 1.0
        )
        now = utcnow()
        deadline = now + timedelta(seconds=t.scheduling.deadline_seconds)
        opened = open_assignments(self.c, claimed, job_id, self.host.id, live.snapshot_version, fraction, now, deadline)
        self.headroom[job_id] -= len(claimed)
        for cl in claimed:
            assignment_id = opened[cl.workunit_id]
            self.out.append(self._describe(assignment_id, cl, live, t, fraction, deadline))
            log.info(
                "assignment %s: job %s epoch %d shard %d -> host %s (%sbase v%d, local fraction %.2f, deadline %s)",
                assignment_id,
                job_id,
                cl.epoch,
                cl.shard_index,
                self.host.id,
                kind,
                live.snapshot_version,
                fraction,
                deadline.isoformat(timespec="seconds"),
                extra=ids(
                    job_id=job_id,
                    epoch=cl.epoch,
                    workunit_id=cl.workunit_id,
                    assignment_id=assignment_id,
                    host_id=self.host.id,
                ),
            )

    def _write_unwritten_shards(self, job_id: int, claimed: list[Claim]) -> list[Claim]:
        """Write the re-dealt shards of an epoch (dataset.reshuffle_each_epoch) before handing one out."""
        job = self.job(job_id)
        for epoch in sorted({cl.shard_epoch for cl in claimed if cl.shard_sha256 is None}):
            write_epoch_shards(self.s, self.storage, job, epoch)
        self.s.flush()
        shards = {
            sh.id: sh for sh in self.s.scalars(select(Shard).where(Shard.id.in_({cl.shard_id for cl in claimed})))
        }
        return [
            Claim(cl.workunit_id, cl.epoch, sh.id, sh.index, sh.epoch, sh.key, sh.sha256, sh.size)
            for cl in claimed
            for sh in (shards[cl.shard_id],)
        ]

    def _describe(
        self, assignment_id: int, cl: Claim, live: LiveJob, t: JobTerms, fraction: float, deadline: datetime
    ) -> AssignmentOut:
        # Written at submission, or (a re-dealt epoch's shard) before its first dispatch; v0 is published at submission.
        assert cl.shard_sha256 is not None and live.snapshot_key is not None and live.snapshot_sha256 is not None
        # Object storage that can presign serves the bytes itself; otherwise the scheduler does.
        shard_url = (
            file_refs.presigned_url(self.storage, cl.shard_key, self.presign_seconds) or f"/v1/shards/{cl.shard_id}"
        )
        signed = (
            SignedRecipe(recipe=t.recipe_text, public_key=live.recipe_public_key, signature=live.recipe_signature)
            if t.recipe_text is not None and live.recipe_public_key is not None and live.recipe_signature is not None
            else None
        )
        return AssignmentOut.model_construct(
            assignment_id=assignment_id,
            job_id=live.id,
            workunit_id=cl.workunit_id,
            epoch=cl.epoch,
            shard_index=cl.shard_index,
            base_version=live.snapshot_version,
            deadline=deadline.replace(tzinfo=UTC),  # as the schema's UtcDatetime makes it, unvalidated here
            local_fraction=fraction,
            recipe=t.recipe.model_copy(update={"seed": t.spec["seed"] + assignment_id}),
            shard=FileRef(url=shard_url, sha256=cl.shard_sha256, size=cl.shard_size),
            snapshot=file_refs.snapshot_ref(
                self.storage,
                live.id,
                live.snapshot_version,
                live.snapshot_key,
                live.snapshot_sha256,
                live.param_bytes,
                self.presign_seconds,
            ),
            signed=signed,
            bind_at_start=t.scheduling.snapshot_binding == "start",
        )
