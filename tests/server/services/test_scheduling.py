"""Scheduling as BOINC operators expect it, on a real ledger (SQLite and PostgreSQL) and a private
Redis: fair share between jobs by weight, heartbeats that extend a live lease up to a bound, and
straggler duplicates at an epoch's tail whose first valid result wins, with exact accounting."""

import random
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import redis
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.evaluate import FrameworkEvaluator
from crowdtrain.assimilator.merge import MergeServices, Outcome, assimilate
from crowdtrain.core import keys
from crowdtrain.core.assimilationspec import assimilation_of
from crowdtrain.core.jobspec import WORKUNIT_MODES, load_job_spec
from crowdtrain.core.refusals import RefusalKind
from crowdtrain.core.schemas import ResultMetrics
from crowdtrain.core.settings import Settings
from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.core.tensors import encode
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger import duplicates, merges
from crowdtrain.server.ledger.assignments import ResultProblem, give_up, heartbeat, time_out_expired
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host, Workunit, utcnow
from crowdtrain.server.paramstore import merging, store
from crowdtrain.server.services.dispatch import request_work
from crowdtrain.server.services.fair_share import split_slots
from crowdtrain.server.services.results import store_result
from crowdtrain.workgen.generator import submit_job
from tests.conftest import EXAMPLE_SPEC

BOTH_DATABASES = pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)


@dataclass
class Ledger:
    db: sessionmaker[Session]
    storage: Storage
    r: redis.Redis
    var: Path

    def submit(self, subsets: int, max_epochs: int = 50, assimilation: dict | None = None, **scheduling) -> int:
        """The example job on a small random dataset (quick to prepare) with `scheduling` options (and
        `assimilation` ones)."""
        data = self.var / "small.npz"
        if not data.exists():
            rng = np.random.default_rng(0)
            np.savez(
                data,
                x=rng.standard_normal((800, 40)).astype(np.float32),
                y=np.arange(800) % 10,
                x_val=rng.standard_normal((50, 40)).astype(np.float32),
                y_val=np.arange(50) % 10,
            )
        spec = load_job_spec(EXAMPLE_SPEC)
        spec.dataset.source, spec.dataset.subsets = f"npz:{data}", subsets
        spec.stop.max_epochs, spec.stop.target_accuracy = max_epochs, 0.01
        spec.scheduling = spec.scheduling.model_copy(update=scheduling)
        if assimilation:
            spec.assimilation = assimilation_of(spec.assimilation.model_dump(mode="json") | assimilation)
        return submit_job(self.db, self.storage, self.r, spec, Settings().upload_max_bytes).job_id

    def hosts(self, n: int) -> list[int]:
        with self.db.begin() as s:
            start = s.scalar(select(func.count()).select_from(Host))
            hosts = [Host(name=f"h{start + i}", token_hash=f"{start + i:064d}") for i in range(n)]
            s.add_all(hosts)
            s.flush()
            return [h.id for h in hosts]

    def upload(self, host_id: int, job_id: int, assignment_id: int) -> None:
        """A valid result: W_s as published, moved a little (an update of zero is refused: no training)."""
        rng = np.random.default_rng(assignment_id)
        w_s = store.read(self.r, job_id)[1]
        body = encode(
            {
                k: (v + 1e-4 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
                for k, v in w_s.items()
            }
        )
        store_result(self.db, self.storage, host_id, job_id, assignment_id, body, ResultMetrics(), lambda *_: None)

    def merge(self, assignment_id: int) -> Outcome:
        return assimilate(MergeServices(self.db, self.storage, self.r, snapshots_kept=3), assignment_id).outcome

    def age(self, assignment_id: int, seconds: float) -> None:
        """Move an assignment `seconds` into the past: its sending, deadline and last heartbeat."""
        shift = timedelta(seconds=seconds)
        with self.db.begin() as s:
            a = s.get_one(Assignment, assignment_id)
            a.sent_at -= shift
            a.deadline -= shift
            if a.last_heartbeat is not None:
                a.last_heartbeat -= shift

    def assignment(self, assignment_id: int) -> Assignment:
        with self.db.begin() as s:
            a = s.get_one(Assignment, assignment_id)
            s.expunge(a)
            return a

    def workunit(self, workunit_id: int) -> tuple[str, int]:
        with self.db.begin() as s:
            wu = s.get_one(Workunit, workunit_id)
            return wu.status, wu.error_count

    def host(self, host_id: int) -> tuple[int, int]:
        with self.db.begin() as s:
            h = s.get_one(Host, host_id)
            return h.results_valid, h.results_failed


@pytest.fixture
def ledger(database_url, private_redis, tmp_path) -> Ledger:
    upgrade(database_url)
    return Ledger(session_factory(database_url), open_storage((tmp_path / "storage").as_uri()), private_redis, tmp_path)


# Fair share


def test_free_slots_are_split_by_weight() -> None:
    """The pure split: slots go to the job furthest below its weighted share, ties to the older."""
    assert split_slots(6, {}, {1: 2.0, 2: 1.0}) == {1: 4, 2: 2}
    assert split_slots(3, {}, {1: 1.0, 2: 1.0}) == {1: 2, 2: 1}
    assert split_slots(2, {1: 5, 2: 1}, {1: 1.0, 2: 1.0}) == {1: 0, 2: 2}
    assert split_slots(4, {}, {}) == {}


@BOTH_DATABASES
@pytest.mark.parametrize(("weights", "share"), [((1, 1), 1 / 2), ((2, 1), 2 / 3)], ids=["1-1", "2-1"])
def test_two_running_jobs_share_the_dispatches_by_weight(ledger, weights, share) -> None:
    """12 hosts, one slot each, ask for work 40 rounds; each assignment runs 1-4 rounds. Oldest job
    first would give the first job everything (it never runs out of ready work); fair share gives
    it `share` of the dispatches within 0.06, and of the running assignments within one."""
    first = ledger.submit(subsets=40, weight=weights[0])
    second = ledger.submit(subsets=40, weight=weights[1])
    hosts = ledger.hosts(12)
    rng = random.Random(0)
    held: dict[int, tuple[int, int, int]] = {}  # host -> (assignment, job, rounds left)
    dispatched: Counter[int] = Counter()
    for _ in range(40):
        for h in hosts:
            if h in held:
                aid, job_id, left = held.pop(h)
                if left > 1:
                    held[h] = (aid, job_id, left - 1)
                    continue
                give_up(
                    ledger.db,
                    ledger.storage,
                    ledger.r,
                    h,
                    aid,
                    AssignmentStatus.abandoned,
                    "done",
                    FrameworkEvaluator(),
                )
            (a,) = request_work(ledger.db, ledger.storage, h, 1, [], None)
            dispatched[a.job_id] += 1
            held[h] = (a.assignment_id, a.job_id, rng.randint(1, 4))
    total = dispatched[first] + dispatched[second]
    assert total > 150
    assert dispatched[first] / total == pytest.approx(share, abs=0.06), dispatched
    running = Counter(job_id for _, job_id, _ in held.values())
    assert abs(running[first] - share * len(hosts)) <= 1, running


@BOTH_DATABASES
def test_one_request_for_several_slots_is_split_by_weight(ledger) -> None:
    first = ledger.submit(subsets=8, weight=2)
    second = ledger.submit(subsets=8, weight=1)
    (host,) = ledger.hosts(1)
    given = Counter(a.job_id for a in request_work(ledger.db, ledger.storage, host, 6, [], None))
    assert given == {first: 4, second: 2}


# Lease extension


@BOTH_DATABASES
def test_a_heartbeat_extends_a_live_lease_up_to_its_bound(ledger) -> None:
    """deadline_seconds 60, lease_max_factor 3: a host that heartbeats keeps its assignment past the
    original deadline and its result merges; a silent one is timed out; no lease outlives sent + 180 s."""
    job_id = ledger.submit(subsets=4, deadline_seconds=60, lease_max_factor=3)
    live, silent, hung = ledger.hosts(3)
    (a_live,) = request_work(ledger.db, ledger.storage, live, 1, [], None)
    (a_silent,) = request_work(ledger.db, ledger.storage, silent, 1, [], None)
    (a_hung,) = request_work(ledger.db, ledger.storage, hung, 1, [], None)
    for a in (a_live, a_silent):
        ledger.age(a.assignment_id, 50)  # 10 s left of the first lease
    original = ledger.assignment(a_live.assignment_id).deadline

    keep_going, reason, deadline = heartbeat(ledger.db, live, a_live.assignment_id)
    assert keep_going and reason == ""
    assert deadline == ledger.assignment(a_live.assignment_id).deadline
    assert deadline - original > timedelta(seconds=45)  # now + 60 s, not sent + 60 s

    ledger.age(a_live.assignment_id, 30)
    ledger.age(a_silent.assignment_id, 30)  # both 80 s old: past the original 60 s deadline
    assert time_out_expired(ledger.db, ledger.storage, ledger.r, FrameworkEvaluator()) == 1
    assert ledger.assignment(a_silent.assignment_id).status == AssignmentStatus.timed_out.value
    assert ledger.assignment(a_live.assignment_id).status == AssignmentStatus.in_progress.value

    ledger.upload(live, job_id, a_live.assignment_id)
    assert ledger.merge(a_live.assignment_id) == Outcome.merged
    assert ledger.assignment(a_live.assignment_id).status == AssignmentStatus.merged.value

    # The bound: heartbeating all along, a hung host still loses its work at sent + 3 x 60 s.
    ledger.age(a_hung.assignment_id, 170)
    _, _, deadline = heartbeat(ledger.db, hung, a_hung.assignment_id)
    hung_row = ledger.assignment(a_hung.assignment_id)
    assert deadline == hung_row.sent_at + timedelta(seconds=180)
    ledger.age(a_hung.assignment_id, 15)
    _, _, deadline = heartbeat(ledger.db, hung, a_hung.assignment_id)
    assert deadline == ledger.assignment(a_hung.assignment_id).sent_at + timedelta(seconds=180)  # not extended
    assert deadline < utcnow()
    assert time_out_expired(ledger.db, ledger.storage, ledger.r, FrameworkEvaluator()) == 1
    assert ledger.assignment(a_hung.assignment_id).status == AssignmentStatus.timed_out.value
    assert heartbeat(ledger.db, hung, a_hung.assignment_id) == (False, "assignment is timed_out", None)


# Straggler duplicates


@dataclass
class Tail:
    """A one-epoch job of two workunits at its tail: `straggler` holds one for 20 s, `quick` the other
    (just sent); `idle` got a duplicate of the straggler's workunit."""

    job_id: int
    straggler: int  # host ids
    quick: int
    idle: int
    original: int  # assignment ids
    other: int
    duplicate: int
    workunit: int


def _tail(ledger: Ledger) -> Tail:
    # A straggler is 300 s old: far more than a loaded machine takes between two requests here, so
    # only the assignment moved into the past below is one.
    job_id = ledger.submit(subsets=2, max_epochs=1, duplicate_after_seconds=300, deadline_seconds=3600)
    straggler, quick, idle = ledger.hosts(3)
    (original,) = request_work(ledger.db, ledger.storage, straggler, 1, [], None)
    (other,) = request_work(ledger.db, ledger.storage, quick, 1, [], None)
    assert request_work(ledger.db, ledger.storage, idle, 1, [], None) == [], "no straggler is 300 s old yet"
    ledger.age(original.assignment_id, 400)
    assert request_work(ledger.db, ledger.storage, straggler, 1, [], None) == [], "never its own workunit"
    (duplicate,) = request_work(ledger.db, ledger.storage, idle, 2, [], None)
    assert duplicate.workunit_id == original.workunit_id
    assert duplicate.base_version == original.base_version
    # At most two live assignments per workunit: the duplicated one is not duplicated again, and the
    # other assignment is not a straggler yet.
    (late,) = ledger.hosts(1)
    assert request_work(ledger.db, ledger.storage, late, 1, [], None) == []
    return Tail(
        job_id,
        straggler,
        quick,
        idle,
        original.assignment_id,
        other.assignment_id,
        duplicate.assignment_id,
        original.workunit_id,
    )


def _assert_accounting(ledger: Ledger, t: Tail, winner: int, loser: int, winner_host: int, loser_host: int) -> None:
    """The workunit is done once, from `winner`; `loser` ended superseded, neither charged nor credited;
    W_s's version counts distinct merged workunits, and Redis and the ledger agree on what it holds."""
    assert ledger.assignment(winner).status == AssignmentStatus.merged.value
    lost = ledger.assignment(loser)
    assert lost.status == AssignmentStatus.superseded.value
    assert f"assignment {winner}" in lost.message or "another assignment" in lost.message
    assert ledger.workunit(t.workunit) == (WorkunitStatus.done.value, 0)
    assert ledger.host(winner_host) == (1, 0)
    assert ledger.host(loser_host) == (0, 0)
    with ledger.db.begin() as s:
        merged = s.execute(
            select(Assignment.id, Assignment.workunit_id).where(
                Assignment.job_id == t.job_id, Assignment.status == AssignmentStatus.merged.value
            )
        ).all()
        done = s.scalars(
            select(Workunit.id).where(Workunit.job_id == t.job_id, Workunit.status == WorkunitStatus.done.value)
        ).all()
    assert len({wu for _, wu in merged}) == len(merged) == len(done)
    assert int(ledger.r.get(keys.version(t.job_id))) == len(merged)
    assert {int(m) for m in ledger.r.smembers(keys.merged(t.job_id))} == {aid for aid, _ in merged}
    assert int(ledger.r.hget(keys.merged_workunits(t.job_id), str(t.workunit))) == winner
    assert not [p for p in (ledger.var / "storage").rglob("*") if "uploads" in p.parts and p.is_file()]


@BOTH_DATABASES
def test_the_duplicate_wins_and_the_running_straggler_is_told_to_stop(ledger) -> None:
    t = _tail(ledger)
    ledger.upload(t.idle, t.job_id, t.duplicate)
    assert ledger.merge(t.duplicate) == Outcome.merged
    # The straggler hears at its next heartbeat, and its late upload is refused politely (409).
    assert heartbeat(ledger.db, t.straggler, t.original) == (False, "assignment is superseded", None)
    with pytest.raises(ResultProblem) as refused:
        ledger.upload(t.straggler, t.job_id, t.original)
    assert refused.value.kind == RefusalKind.conflict
    _assert_accounting(ledger, t, t.duplicate, t.original, t.idle, t.straggler)


@BOTH_DATABASES
def test_when_both_upload_the_first_merged_wins_and_the_other_is_never_merged(ledger) -> None:
    t = _tail(ledger)
    ledger.upload(t.straggler, t.job_id, t.original)
    ledger.upload(t.idle, t.job_id, t.duplicate)
    assert ledger.merge(t.original) == Outcome.merged
    assert ledger.merge(t.duplicate) == Outcome.nothing_to_merge  # ended superseded by the winner's record
    assert ledger.merge(t.duplicate) == Outcome.nothing_to_merge  # a redelivery changes nothing
    _assert_accounting(ledger, t, t.original, t.duplicate, t.straggler, t.idle)


@BOTH_DATABASES
def test_a_result_whose_workunit_w_s_already_holds_is_superseded_not_merged(ledger) -> None:
    """The race the ledger cannot see: the duplicate is in W_s but its merge is not yet recorded (its
    parameter server died) when the straggler's merge runs. W_s takes one result per workunit."""
    t = _tail(ledger)
    ledger.upload(t.straggler, t.job_id, t.original)
    ledger.upload(t.idle, t.job_id, t.duplicate)
    merging.merge_once(
        ledger.r, t.job_id, t.duplicate, lambda params, _state, _v: params, workunit_id=t.workunit
    )  # the dead server's merge
    version = int(ledger.r.get(keys.version(t.job_id)))
    assert ledger.merge(t.original) == Outcome.superseded
    assert int(ledger.r.get(keys.version(t.job_id))) == version, "W_s took a second result for the workunit"
    assert ledger.merge(t.duplicate) == Outcome.already_merged  # the redelivered task records it
    _assert_accounting(ledger, t, t.duplicate, t.original, t.idle, t.straggler)


@BOTH_DATABASES
def test_a_workunit_whose_winner_fails_after_superseding_its_duplicate_is_dealt_again(ledger) -> None:
    """The race behind a stalled epoch: the duplicate is merged into W_s, the straggler's merge
    decides `superseded`, Redis then loses everything, so the winner's merge is recorded as failed
    while the straggler is still uploaded (the workunit stays in progress), and the straggler's end
    comes last. Nothing holds the workunit then: it is ready again, dealt and merged once."""
    t = _tail(ledger)
    ledger.upload(t.straggler, t.job_id, t.original)
    ledger.upload(t.idle, t.job_id, t.duplicate)
    merging.merge_once(ledger.r, t.job_id, t.duplicate, lambda params, _state, _v: params, workunit_id=t.workunit)
    ledger.r.flushall()
    assert merges.end_failed_merge(
        ledger.db, ledger.storage, ledger.r, t.duplicate, "NoServerModel", False, FrameworkEvaluator()
    )
    assert ledger.workunit(t.workunit) == (WorkunitStatus.in_progress.value, 0), "the straggler still holds it"
    duplicates.supersede_result(ledger.db, t.original, t.duplicate)
    assert ledger.workunit(t.workunit) == (WorkunitStatus.ready.value, 0)
    merges.restore_server_model(ledger.db, ledger.storage, ledger.r, t.job_id)  # as the next merge pass does
    (late,) = ledger.hosts(1)
    (again,) = request_work(ledger.db, ledger.storage, late, 1, [], None)
    assert again.workunit_id == t.workunit
    ledger.upload(late, t.job_id, again.assignment_id)
    assert ledger.merge(again.assignment_id) == Outcome.merged
    assert ledger.workunit(t.workunit) == (WorkunitStatus.done.value, 0)


def _rejected_while_merged(ledger: Ledger, t: Tail) -> int:
    """The race behind a workunit dealt without end: the duplicate's merge fails on one parameter
    server (Redis lost everything; its assignment is rejected, uncharged, and, the straggler having
    given up, its workunit is ready again) while a pass on another, which read it still uploaded,
    writes it into W_s. Returns the W_s version that holds it."""
    give_up(
        ledger.db,
        ledger.storage,
        ledger.r,
        t.straggler,
        t.original,
        AssignmentStatus.abandoned,
        "the volunteer stopped it",
        FrameworkEvaluator(),
    )
    ledger.upload(t.idle, t.job_id, t.duplicate)
    assert merges.end_failed_merge(
        ledger.db, ledger.storage, ledger.r, t.duplicate, "NoServerModel", False, FrameworkEvaluator()
    )
    assert ledger.assignment(t.duplicate).status == AssignmentStatus.rejected.value
    assert ledger.workunit(t.workunit)[0] == WorkunitStatus.ready.value
    outcome = merging.merge_once(
        ledger.r, t.job_id, t.duplicate, lambda params, _state, _v: params, workunit_id=t.workunit
    )
    return outcome.version


def _assert_done_from(ledger: Ledger, t: Tail, winner: int, version: int) -> None:
    """`winner` is recorded merged at `version` and its host credited; its workunit is done and dealt no more."""
    merged = ledger.assignment(winner)
    assert (merged.status, merged.merged_version) == (AssignmentStatus.merged.value, version)
    assert f"W_s v{version}" in merged.message
    assert ledger.workunit(t.workunit)[0] == WorkunitStatus.done.value
    assert ledger.host(t.idle) == (1, 0)
    (late,) = ledger.hosts(1)
    assert t.workunit not in {a.workunit_id for a in request_work(ledger.db, ledger.storage, late, 4, [], None)}


@BOTH_DATABASES
def test_a_result_rejected_while_a_pass_merged_it_is_recorded_merged(ledger) -> None:
    t = _tail(ledger)
    version = _rejected_while_merged(ledger, t)
    merges.record_merge(ledger.db, t.duplicate, version)  # the pass's record, after the rejection
    _assert_done_from(ledger, t, t.duplicate, version)


@BOTH_DATABASES
def test_a_workunit_w_s_holds_from_a_rejected_result_is_done_when_the_next_result_of_it_is_superseded(
    ledger,
) -> None:
    """The pass that merged the rejected result died before its record: the workunit is dealt again,
    and the new result's merge finds W_s holding the workunit. It records the winner merged, so the
    workunit is done, instead of making it ready again for a result W_s will supersede again."""
    t = _tail(ledger)
    version = _rejected_while_merged(ledger, t)
    (again_host,) = ledger.hosts(1)
    (again,) = request_work(ledger.db, ledger.storage, again_host, 1, [], None)
    assert again.workunit_id == t.workunit
    ledger.upload(again_host, t.job_id, again.assignment_id)
    assert ledger.merge(again.assignment_id) == Outcome.superseded
    assert ledger.assignment(again.assignment_id).status == AssignmentStatus.superseded.value
    assert ledger.host(again_host) == (0, 0)
    _assert_done_from(ledger, t, t.duplicate, version)


@BOTH_DATABASES
def test_the_transitioner_makes_ready_a_workunit_no_assignment_holds(ledger) -> None:
    t = _tail(ledger)
    assert duplicates.release_orphaned_workunits(ledger.db, WORKUNIT_MODES) == 0, "every workunit is held"
    with ledger.db.begin() as s:  # a lost step: both assignments ended, the workunit left in progress
        s.execute(
            update(Assignment)
            .where(Assignment.id.in_([t.original, t.duplicate]))
            .values(status=AssignmentStatus.abandoned.value)
        )
    assert duplicates.release_orphaned_workunits(ledger.db, WORKUNIT_MODES) == 1
    assert ledger.workunit(t.workunit) == (WorkunitStatus.ready.value, 0)
    assert ledger.workunit(_other_workunit(ledger, t)) == (WorkunitStatus.in_progress.value, 0), "still held"
    assert duplicates.release_orphaned_workunits(ledger.db, WORKUNIT_MODES) == 0


def _other_workunit(ledger: Ledger, t: Tail) -> int:
    return ledger.assignment(t.other).workunit_id


@BOTH_DATABASES
def test_a_straggler_that_times_out_leaves_its_workunit_to_the_duplicate(ledger) -> None:
    t = _tail(ledger)
    with ledger.db.begin() as s:
        s.execute(
            update(Assignment).where(Assignment.id == t.original).values(deadline=utcnow() - timedelta(seconds=1))
        )
    assert time_out_expired(ledger.db, ledger.storage, ledger.r, FrameworkEvaluator()) == 1
    assert ledger.workunit(t.workunit) == (WorkunitStatus.in_progress.value, 1), "still running on the duplicate"
    ledger.upload(t.idle, t.job_id, t.duplicate)
    assert ledger.merge(t.duplicate) == Outcome.merged
    assert ledger.workunit(t.workunit) == (WorkunitStatus.done.value, 1)
    assert ledger.assignment(t.original).status == AssignmentStatus.timed_out.value
