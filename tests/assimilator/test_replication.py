"""Replicated workunits end to end through the real dispatch, upload and merge paths (no Celery): a real
SQLite ledger, file storage, a private Redis, and results trained by the client's PyTorch trainer.

Hosts are new, so a job that replicates untrusted hosts' work gives each workunit to two of them;
their results are judged by quorum before one is merged. Then reputation: trust, quarantine, release.
"""

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select

from crowdtrain.assimilator.merge import MergeServices, Outcome, assimilate
from crowdtrain.client.trainers.pytorch import train
from crowdtrain.core import keys, merge_stages
from crowdtrain.core.assimilationspec import assimilation_of
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas import AssignmentOut, HostRegister, ResultMetrics
from crowdtrain.core.settings import Settings
from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.core.tensors import Params, decode, decode_shard
from crowdtrain.core.updates import encode_result
from crowdtrain.core.validationspec import ValidationSpec
from crowdtrain.server.ledger.models import Assignment, Host, Shard, Workunit, utcnow
from crowdtrain.server.ledger.models import Job as JobRow
from crowdtrain.server.ledger.replicas import replica_wait
from crowdtrain.server.paramstore import store
from crowdtrain.server.services.diagnosis import job_problems
from crowdtrain.server.services.dispatch import request_work
from crowdtrain.server.services.hosts import register_host, release_host
from crowdtrain.server.services.results import store_result
from crowdtrain.server.services.transitioner import close_stalled_votes
from crowdtrain.workgen.generator import submit_job
from tests.conftest import EXAMPLE_SPEC

TOKEN = "join-token-for-this-test"


@dataclass
class Project:
    services: MergeServices
    job_id: int
    upload_spec: dict

    def host(self, name: str) -> int:
        return register_host(self.services.db, HostRegister(join_token=TOKEN, name=name, account=name), TOKEN).host_id

    def work(self, host_id: int, slots: int = 1) -> list[AssignmentOut]:
        return request_work(self.services.db, self.services.storage, host_id, slots, [], None)

    def base(self, a: AssignmentOut) -> Params:
        return decode(self.services.storage.get(keys.snapshot_key(self.job_id, a.base_version)))

    def trained(self, a: AssignmentOut) -> Params:
        """What an honest host returns: the client's trainer run on the assignment's shard."""
        with self.services.db.begin() as s:
            shard_key = s.get_one(Shard, s.get_one(Workunit, a.workunit_id).shard_id).key
        x, y = decode_shard(self.services.storage.get(shard_key))
        return train(a.recipe.model_dump(), self.base(a), x, y).params

    def upload(self, host_id: int, a: AssignmentOut, params: Params) -> None:
        body = encode_result(params, self.base(a), self.upload_spec)
        store_result(
            self.services.db,
            self.services.storage,
            host_id,
            self.job_id,
            a.assignment_id,
            body,
            ResultMetrics(),
            lambda *_: None,
        )

    def status(self, assignment_id: int) -> str:
        with self.services.db.begin() as s:
            return s.get_one(Assignment, assignment_id).status

    def record(self, host_id: int) -> tuple[int, int, float, bool]:
        """(valid, failed, credit, quarantined)"""
        with self.services.db.begin() as s:
            h = s.get_one(Host, host_id)
            return h.results_valid, h.results_failed, h.credit, h.quarantined_until is not None

    def workunit(self, workunit_id: int) -> tuple[str, int, int | None]:
        with self.services.db.begin() as s:
            wu = s.get_one(Workunit, workunit_id)
            return wu.status, wu.quorum, wu.canonical_assignment_id


def _project(services: MergeServices, **validation) -> Project:
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.validation = ValidationSpec(**validation)
    spec.scheduling.duplicate_after_seconds = None
    # The paper's rule: a replica's held-out loss is W_s's after the rule merged it alone, and α 0.6
    # moves W_s far enough for a sign-flipped update to show there (the default's first steps are 1/16).
    spec.assimilation = assimilation_of(dict(rule="vc-asgd", alpha=0.6))
    job_id = submit_job(services.db, services.storage, services.r, spec, Settings().upload_max_bytes).job_id
    return Project(services, job_id, spec.assimilation.upload.model_dump())


def _sign_flipped(p: Project, a: AssignmentOut) -> Params:
    base, honest = p.base(a), p.trained(a)
    return {k: (2 * v - honest[k]).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in base.items()}


def test_two_honest_replicas_agree_one_is_merged_and_both_are_credited(services) -> None:
    p = _project(services, replicate_untrusted=True)
    alice, bob = p.host("alice"), p.host("bob")
    [a] = p.work(alice)
    [b] = p.work(bob)
    assert b.workunit_id == a.workunit_id, "the new host's workunit is replicated to the next host first"
    assert p.workunit(a.workunit_id)[1] == 2

    p.upload(alice, a, p.trained(a))
    assert assimilate(services, a.assignment_id).outcome is Outcome.awaiting_replicas
    assert store.read(services.r, p.job_id)[0] == 0, "nothing merged before the quorum is in"
    assert "1 results wait for replicas" in " ".join(job_problems(services.db, p.job_id).findings)
    p.upload(bob, b, p.trained(b))
    result = assimilate(services, b.assignment_id)

    assert store.read(services.r, p.job_id)[0] == 1, "W_s takes one result per workunit"
    statuses = sorted([p.status(a.assignment_id), p.status(b.assignment_id)])
    assert statuses == [AssignmentStatus.merged.value, AssignmentStatus.validated.value]
    status, _, canonical = p.workunit(a.workunit_id)
    assert status == WorkunitStatus.done.value and canonical in (a.assignment_id, b.assignment_id)
    assert result.outcome in (Outcome.merged, Outcome.validated)
    for host in (alice, bob):
        valid, failed, credit, _ = p.record(host)
        assert (valid, failed) == (1, 0) and credit > 0
    assert p.record(alice)[2] == pytest.approx(p.record(bob)[2]), "the same work earns the same credit"
    assert assimilate(services, a.assignment_id).outcome in (Outcome.already_merged, Outcome.nothing_to_merge)
    assert store.read(services.r, p.job_id)[0] == 1


@pytest.mark.parametrize("hostile", ["sign-flipped", "lazy"])
def test_a_hostile_replica_is_outvoted_refused_and_earns_nothing(services, hostile) -> None:
    p = _project(services, replicate_untrusted=True)
    honest, mallory, carol = p.host("honest"), p.host("mallory"), p.host("carol")
    [a] = p.work(honest)
    [m] = p.work(mallory)
    p.upload(honest, a, p.trained(a))
    p.upload(mallory, m, _sign_flipped(p, m) if hostile == "sign-flipped" else p.base(m))
    assert assimilate(services, a.assignment_id).outcome is Outcome.awaiting_replicas
    assert assimilate(services, m.assignment_id).outcome is Outcome.awaiting_replicas, (
        "two that disagree ask for a third"
    )
    assert p.workunit(a.workunit_id)[1] == 3 and store.read(services.r, p.job_id)[0] == 0

    [c] = p.work(carol)
    assert c.workunit_id == a.workunit_id
    p.upload(carol, c, p.trained(c))
    assimilate(services, c.assignment_id)

    assert p.status(m.assignment_id) == AssignmentStatus.rejected.value
    assert {p.status(a.assignment_id), p.status(c.assignment_id)} == {"merged", "validated"}
    assert store.read(services.r, p.job_id)[0] == 1
    assert not services.r.sismember(keys.merged(p.job_id), str(m.assignment_id))
    assert p.record(mallory)[:3] == (0, 1, 0.0), "refused, charged, no credit"
    assert p.record(honest)[:2] == (1, 0) and p.record(carol)[:2] == (1, 0)
    with services.db.begin() as s:
        message = s.get_one(Assignment, m.assignment_id).message
    expected = "held-out loss" if hostile == "sign-flipped" else "update is zero"
    assert message.startswith("refused by replica validation") and expected in message, message


def test_a_colluding_pair_sharing_an_untrained_direction_is_refused_and_earns_nothing(services) -> None:
    """Two hosts of two accounts upload W_base + d + ε with one random direction d (of an honest
    update's norm) and private noises ε: they agree with each other, but neither fits its shard."""
    p = _project(services, replicate_untrusted=True)
    mallory, trudy = p.host("mallory"), p.host("trudy")
    [m] = p.work(mallory)
    [t] = p.work(trudy)
    assert t.workunit_id == m.workunit_id
    base = p.base(m)
    size = np.sqrt(sum(float(np.sum((v - base[k]).astype(np.float64) ** 2)) for k, v in p.trained(m).items()))
    rng = np.random.default_rng(7)
    d = {k: rng.standard_normal(v.shape) for k, v in base.items() if v.dtype.kind == "f"}
    d_norm = np.sqrt(sum(float(np.sum(x**2)) for x in d.values()))

    def forged() -> Params:
        return {
            k: (v + size * (d[k] / d_norm + 0.02 * rng.standard_normal(v.shape) / d_norm)).astype(v.dtype)
            if k in d
            else v
            for k, v in base.items()
        }

    p.upload(mallory, m, forged())
    assert assimilate(services, m.assignment_id).outcome is Outcome.awaiting_replicas
    p.upload(trudy, t, forged())
    assert assimilate(services, t.assignment_id).outcome is Outcome.refused

    assert p.status(m.assignment_id) == p.status(t.assignment_id) == AssignmentStatus.rejected.value
    assert store.read(services.r, p.job_id)[0] == 0, "nothing merged"
    assert p.workunit(m.workunit_id)[0] == WorkunitStatus.ready.value, "trained again, by others"
    for host in (mallory, trudy):
        assert p.record(host)[:3] == (0, 1, 0.0), "refused, charged, no credit"
    with services.db.begin() as s:
        message = s.get_one(Assignment, m.assignment_id).message
    assert "shows no training on the workunit's shard" in message, message


def test_a_trusted_host_is_not_replicated_and_an_untrusted_one_always_is(services) -> None:
    p = _project(services, replicate_untrusted=True, trusted_after=2)
    veteran, newcomer = p.host("veteran"), p.host("newcomer")
    with services.db.begin() as s:
        s.get_one(Host, veteran).consecutive_valid = 2
    [v] = p.work(veteran)
    [n] = p.work(newcomer)
    assert n.workunit_id != v.workunit_id, "the veteran's workunit wants no replica"
    assert p.workunit(v.workunit_id)[1] == 1 and p.workunit(n.workunit_id)[1] == 2


def test_repeated_refusals_quarantine_a_host_until_the_operator_releases_it(services) -> None:
    p = _project(services, replicate_untrusted=False, quarantine_after=2)
    mallory = p.host("mallory")
    for _ in range(2):
        [a] = p.work(mallory)
        p.upload(mallory, a, {k: np.full_like(v, np.nan) for k, v in p.base(a).items()})
        assert assimilate(services, a.assignment_id).outcome is Outcome.refused
    valid, failed, _, quarantined = p.record(mallory)
    assert (valid, failed, quarantined) == (0, 2, True)
    assert p.work(mallory, 4) == [], "a quarantined host gets no work"
    assert "1 of the 1 hosts able to run this job are quarantined" in " ".join(
        job_problems(services.db, p.job_id).findings
    )
    with services.db.begin() as s:
        reason = s.get_one(Host, mallory).quarantine_reason
    assert "2 results refused in a row" in reason and "invalid result" in reason, reason

    released = release_host(services.db, mallory)
    assert released.quarantined_until is None and released.consecutive_refused == 0
    assert len(p.work(mallory)) == 1


def test_a_valid_result_ends_a_run_of_refusals(services) -> None:
    p = _project(services, replicate_untrusted=False, quarantine_after=2)
    host = p.host("flaky")
    [bad] = p.work(host)
    p.upload(host, bad, {k: np.full_like(v, np.nan) for k, v in p.base(bad).items()})
    assimilate(services, bad.assignment_id)
    [good] = p.work(host)
    p.upload(host, good, p.trained(good))
    assert assimilate(services, good.assignment_id, stamps=merge_stages.received()).outcome is Outcome.merged
    [bad2] = p.work(host)
    p.upload(host, bad2, {k: np.full_like(v, np.nan) for k, v in p.base(bad2).items()})
    assimilate(services, bad2.assignment_id)
    assert p.record(host)[3] is False, "two refusals, but not in a row"
    with services.db.begin() as s:
        assert s.scalar(select(Host.consecutive_refused).where(Host.id == host)) == 1


def test_the_hosts_of_an_inconclusive_vote_may_replicate_the_workunit_trained_again(services) -> None:
    """With only two hosts, both of the first vote, the second vote's replica still finds a host. (Both
    return the base unchanged: bob's upload is also a copy of alice's, a replay, which ends the vote;
    alice's lazy replica is judged, not left valid by default.)"""
    p = _project(services, replicate_untrusted=True, max_replicas=2)
    alice, bob = p.host("alice"), p.host("bob")
    [a] = p.work(alice)
    [b] = p.work(bob)
    assert b.workunit_id == a.workunit_id
    for host, assignment in ((alice, a), (bob, b)):  # both lazy: no two plausible replicas agree
        p.upload(host, assignment, p.base(assignment))
        assimilate(services, assignment.assignment_id)
    assert p.status(a.assignment_id) == p.status(b.assignment_id) == AssignmentStatus.rejected.value
    assert p.workunit(a.workunit_id)[0] == WorkunitStatus.ready.value, "inconclusive: trained again"
    assert p.record(alice)[2] == p.record(bob)[2] == 0.0, "no credit: bob's copy of alice's weights ended the vote"

    assert a.workunit_id in {w.workunit_id for w in p.work(alice, 8)}
    replicas = [w for w in p.work(bob, 8) if w.workunit_id == a.workunit_id]
    assert len(replicas) == 1, "bob, who voted last time, holds a replica of the new vote"
    assert p.workunit(a.workunit_id)[1] == 2
    assert [w for w in p.work(alice, 8) if w.workunit_id == a.workunit_id] == [], "never two replicas of one vote"


@pytest.mark.parametrize("replicated", [False, True])
def test_a_replayed_result_is_refused_charged_and_earns_nothing(services, replicated) -> None:
    """A host uploads its first result again for a later assignment: the same weights under another
    assignment are refused as a replay, whether the workunit is replicated or not."""
    p = _project(services, replicate_untrusted=replicated)
    mallory, honest = p.host("mallory"), p.host("honest")
    [first] = p.work(mallory)
    old = p.trained(first)
    p.upload(mallory, first, old)
    assimilate(services, first.assignment_id)
    credit = p.record(mallory)[2]
    [later] = p.work(mallory)
    if replicated:
        [replica] = [a for a in p.work(honest, 4) if a.workunit_id == later.workunit_id]
        p.upload(honest, replica, p.trained(replica))
    p.upload(mallory, later, old)
    assimilate(services, later.assignment_id)

    assert p.status(later.assignment_id) == AssignmentStatus.rejected.value
    with services.db.begin() as s:
        message = s.get_one(Assignment, later.assignment_id).message
    assert f"those of assignment {first.assignment_id}'s result: a replayed result" in message, message
    valid, failed, after, _ = p.record(mallory)
    assert failed >= 1 and after == credit, "charged, and no credit for the replay"
    if not replicated:
        assert assimilate(services, first.assignment_id).outcome is Outcome.already_merged, "the original is no replay"


def test_a_vote_no_replica_comes_for_closes_inconclusive_and_counts_toward_max_errors(services) -> None:
    """Two hosts of one volunteer account: the replica of a workunit one of them uploaded may go to
    neither, so the vote would wait forever. The transitioner closes it after the bound, the results
    are refused uncharged, and at max_errors the workunit fails."""
    p = _project(services, replicate_untrusted=True, replica_wait_seconds=1)
    with services.db.begin() as s:
        job = s.get_one(JobRow, p.job_id)
        job.spec = job.spec | {"scheduling": job.spec["scheduling"] | {"max_errors": 2}}
    alice = p.host("alice")
    laptop = register_host(services.db, HostRegister(join_token=TOKEN, name="laptop", account="alice"), TOKEN).host_id
    assert replica_wait({"scheduling": {"deadline_seconds": 90}}) == 90, "the deadline when validation says nothing"

    workunit = None
    for error in (1, 2):
        before_sent = utcnow()  # the clock passed in: however long the steps below take on a loaded machine
        [a] = [w for w in p.work(alice, 8) if workunit in (None, w.workunit_id)][:1]
        workunit = a.workunit_id
        p.upload(alice, a, p.trained(a))
        assert assimilate(services, a.assignment_id).outcome is Outcome.awaiting_replicas
        assert all(w.workunit_id != a.workunit_id for w in p.work(laptop, 8)), "never a replica to the same account"
        within = before_sent + timedelta(seconds=0.9)  # under the 1 s bound, counted from its send at the earliest
        assert close_stalled_votes(services.db, services.storage, services.r, services.evaluator, now=within) == 0, (
            "not before the bound"
        )
        past = utcnow() + timedelta(seconds=1.1)
        assert close_stalled_votes(services.db, services.storage, services.r, services.evaluator, now=past) == 1

        with services.db.begin() as s:
            ended = s.get_one(Assignment, a.assignment_id)
            status, message, upload_key = ended.status, ended.message, ended.upload_key
            errors = s.get_one(Workunit, a.workunit_id).error_count
        assert status == AssignmentStatus.rejected.value and errors == error
        assert "replica vote closed inconclusive" in message and "no host took another in 1 s" in message, message
        assert upload_key is not None and not services.storage.exists(upload_key), "its upload is deleted"
        expected = WorkunitStatus.ready if error == 1 else WorkunitStatus.failed
        assert p.workunit(a.workunit_id)[0] == expected.value
        problems = job_problems(services.db, p.job_id)
        assert any("replica vote closed inconclusive" in x.message for x in problems.recent)
    assert p.record(alice)[:3] == (0, 0, 0.0), "nothing charged, nothing credited"
    assert close_stalled_votes(services.db, services.storage, services.r, services.evaluator, utcnow()) == 0
