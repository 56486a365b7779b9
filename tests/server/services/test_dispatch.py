"""Claiming work is atomic: simultaneous requests never get the same workunit."""

import os
import signal
import threading
import time
from datetime import datetime

import httpx
import pytest
from sqlalchemy import event, func, select

from crowdtrain.assimilator.evaluate import FrameworkEvaluator
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas import WorkReply
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.core.storage import open_storage
from crowdtrain.launch.cluster import wait_for
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.epochs import next_epoch_releasable, release_epoch
from crowdtrain.server.ledger.models import Assignment, Job, Shard, Workunit
from crowdtrain.server.services.transitioner import close_finished_epochs
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import scheduler_app

pytestmark = pytest.mark.integration
HOSTS = 200
SHARDS = 100


def register_hosts(cluster, n: int) -> list[str]:
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        return [
            http.post("/v1/hosts", json={"join_token": cluster.join_token, "name": f"h{i}"}).json()["host_token"]
            for i in range(n)
        ]


def test_200_simultaneous_work_requests_on_postgresql_never_share_a_workunit(make_cluster, postgres_url) -> None:
    cluster = make_cluster(postgres_url, server_workers=2)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.dataset.subsets = SHARDS
    with cluster.admin() as http:
        job_id = http.post("/v1/jobs", json=spec.model_dump(mode="json")).json()["job_id"]
    tokens = register_hosts(cluster, HOSTS)
    barrier = threading.Barrier(HOSTS)
    replies: list[list[dict]] = [[] for _ in range(HOSTS)]
    errors: list[str] = []

    def ask(i: int) -> None:
        with httpx.Client(base_url=cluster.url, timeout=120, headers={"Authorization": f"Bearer {tokens[i]}"}) as http:
            barrier.wait()
            resp = http.post("/v1/work", json={"free_slots": 1})
            if resp.status_code != 200:
                errors.append(f"{resp.status_code} {resp.text}")
            else:
                replies[i] = resp.json()["assignments"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(HOSTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]

    given = [a["workunit_id"] for r in replies for a in r]
    # Epoch 1's 100 workunits all go out; once none is ready, epoch 2 is released early and the
    # remaining requests draw from it. No epoch 3: epoch 1 is still open.
    assert len(given) == HOSTS
    assert len(set(given)) == len(given), "a workunit was given to two hosts"
    assert sorted({a["epoch"] for r in replies for a in r}) == [1, 2]
    db = session_factory(postgres_url)
    with db.begin() as s:
        per_wu = s.execute(
            select(Assignment.workunit_id, func.count())
            .where(Assignment.job_id == job_id)
            .group_by(Assignment.workunit_id)
        ).all()
        assert len(per_wu) == HOSTS and all(n == 1 for _, n in per_wu)
        assert s.scalar(select(func.count()).select_from(Workunit).where(Workunit.job_id == job_id)) == 2 * SHARDS
        assert (
            s.scalar(
                select(func.count())
                .select_from(Workunit)
                .where(Workunit.job_id == job_id, Workunit.status == WorkunitStatus.in_progress.value)
            )
            == HOSTS
        )
        assert (
            s.scalar(
                select(func.count())
                .select_from(Assignment)
                .where(Assignment.job_id == job_id, Assignment.status == AssignmentStatus.in_progress.value)
            )
            == HOSTS
        )


def _counters(cluster) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with cluster.admin() as http:
        text = http.get("/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_host_gets_the_workunit_whose_shard_it_has_cached(make_cluster, sqlite_url) -> None:
    from crowdtrain.server.ledger.models import Shard

    cluster = make_cluster(sqlite_url)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.dataset.subsets = 8
    job_id = cluster.submit(spec.model_dump(mode="json"))["job_id"]
    with session_factory(sqlite_url).begin() as s:
        shards = {sh.index: (sh.sha256, sh.size) for sh in s.scalars(select(Shard).where(Shard.job_id == job_id))}
    (token,) = register_hosts(cluster, 1)
    with httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {token}"}) as http:
        cached = http.post("/v1/work", json={"free_slots": 2, "cached_shards": [shards[5][0], shards[6][0]]}).json()
        after = _counters(cluster)
        fresh = http.post("/v1/work", json={"free_slots": 1, "cached_shards": [shards[5][0]]}).json()
    # Cached shards first, though lower-numbered workunits are ready; then the lowest fresh one.
    assert sorted(a["shard_index"] for a in cached["assignments"]) == [5, 6]
    assert [a["shard_index"] for a in fresh["assignments"]] == [0]
    assert after["crowdtrain_dispatches_cached_shard_total"] == 2
    assert after["crowdtrain_shard_bytes_saved_total"] == shards[5][1] + shards[6][1]
    final = _counters(cluster)
    assert final["crowdtrain_shard_bytes_sent_total"] == shards[0][1]
    assert final["crowdtrain_shard_bytes_saved_total"] == after["crowdtrain_shard_bytes_saved_total"]


def test_hosts_are_offered_only_jobs_one_of_their_frameworks_runs(make_cluster, sqlite_url) -> None:
    pytest.importorskip("tensorflow")
    cluster = make_cluster(sqlite_url, assimilator_concurrency=1)
    zoo_job = cluster.submit(load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))["job_id"]
    keras_job = cluster.submit(load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-keras.yaml").model_dump(mode="json"))[
        "job_id"
    ]

    def ask(name: str, frameworks: list[str], slots: int) -> list[int]:
        resources = {"frameworks": frameworks}
        with httpx.Client(base_url=cluster.url, timeout=60) as http:
            token = http.post(
                "/v1/hosts", json={"join_token": cluster.join_token, "name": name, "resources": resources}
            ).json()["host_token"]
            reply = http.post(
                "/v1/work",
                json={"free_slots": slots, "resources": resources},
                headers={"Authorization": f"Bearer {token}"},
            ).json()
        return [a["job_id"] for a in reply["assignments"]]

    # The zoo job (a PyTorch job) goes to a TensorFlow-only host too: TensorFlow has a port of
    # cnn1d. Both jobs run, so the host's two slots are split between them (fair share, weight 1 each).
    assert sorted(ask("tf", ["tensorflow"], 2)) == sorted([zoo_job, keras_job])
    # The rest of epoch 1 and the early-released epoch 2 (4 shards each); the Keras job is skipped.
    assert ask("torch", ["pytorch"], 12) == [zoo_job] * 7
    assert ask("tf-2", ["tensorflow"], 2) == [keras_job] * 2
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        bad = http.post(
            "/v1/hosts", json={"join_token": cluster.join_token, "name": "x", "resources": {"frameworks": ["jax"]}}
        )
    assert bad.status_code == 422 and "frameworks" in bad.text


@pytest.fixture
def scheduler(tmp_path, private_redis):
    with scheduler_app(tmp_path, private_redis) as app:
        yield app


def test_a_dedloc_job_never_produces_workunits(scheduler) -> None:
    spec = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-dedloc.yaml")
    created = scheduler.http.post("/v1/jobs", json=spec.model_dump(mode="json"), headers=scheduler.admin_headers)
    assert created.status_code == 201, created.text
    host = scheduler.register_host()
    # With no VC-ASGD work anywhere, a work request must not release an epoch of the dedloc job.
    for _ in range(2):
        reply = scheduler.http.post("/v1/work", json={"free_slots": 4}, headers=host)
        assert reply.status_code == 200 and reply.json()["assignments"] == []
    assert scheduler.count(Workunit) == 0


def test_epoch_release_and_closing_leave_a_dedloc_job_alone(scheduler, private_redis) -> None:
    spec = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-dedloc.yaml")
    job_id = scheduler.http.post("/v1/jobs", json=spec.model_dump(mode="json"), headers=scheduler.admin_headers).json()[
        "job_id"
    ]
    with scheduler.db.begin() as s:
        job = s.get_one(Job, job_id)
        assert not next_epoch_releasable(s, job)
        with pytest.raises(ValueError, match="dedloc"):
            release_epoch(s, job, 1)
        job.current_epoch = 1  # as the VC-ASGD dispatcher used to leave them
    close_finished_epochs(
        scheduler.db, open_storage(scheduler.settings.resolved_storage_url), private_redis, FrameworkEvaluator()
    )
    with scheduler.db.begin() as s:
        assert s.get_one(Job, job_id).status == JobStatus.running.value
    assert scheduler.count(Workunit) == 0


def test_a_heartbeat_reply_carries_the_extended_deadline(scheduler) -> None:
    spec = load_job_spec(EXAMPLE_SPEC)
    created = scheduler.http.post("/v1/jobs", json=spec.model_dump(mode="json"), headers=scheduler.admin_headers)
    assert created.status_code == 201, created.text
    host = scheduler.register_host()
    (given,) = scheduler.http.post("/v1/work", json={"free_slots": 1}, headers=host).json()["assignments"]
    time.sleep(0.01)
    beat = scheduler.http.post(f"/v1/assignments/{given['assignment_id']}/heartbeat", headers=host).json()
    assert beat["keep_going"] is True
    sent_deadline, extended = (datetime.fromisoformat(d) for d in (given["deadline"], beat["deadline"]))
    assert extended > sent_deadline  # now + deadline_seconds, counted from the heartbeat


def test_a_work_reply_describes_each_assignment_as_the_ledger_holds_it(scheduler) -> None:
    """The reply is built from plain rows, unvalidated: every field must still be the ledger's, of its
    wire type, and the reply must read back as the schema says."""
    spec = load_job_spec(EXAMPLE_SPEC)
    created = scheduler.http.post("/v1/jobs", json=spec.model_dump(mode="json"), headers=scheduler.admin_headers)
    assert created.status_code == 201, created.text
    host = scheduler.register_host()
    reply = scheduler.http.post("/v1/work", json={"free_slots": 3}, headers=host)
    assert reply.status_code == 200
    given = WorkReply.model_validate_json(reply.content).assignments
    assert len(given) == 3
    with scheduler.db.begin() as s:
        job = s.get_one(Job, created.json()["job_id"])
        for a in given:
            row = s.get_one(Assignment, a.assignment_id)
            wu = s.get_one(Workunit, a.workunit_id)
            shard = s.get_one(Shard, wu.shard_id)
            assert (row.workunit_id, row.host_id, row.base_version) == (wu.id, row.host_id, job.snapshot_version)
            assert (a.job_id, a.epoch, a.shard_index, a.base_version) == (
                job.id,
                wu.epoch,
                shard.index,
                job.snapshot_version,
            )
            assert (a.shard.sha256, a.shard.size) == (shard.sha256, shard.size)
            assert (a.snapshot.sha256, a.snapshot.size) == (job.snapshot_sha256, job.param_bytes)
            assert a.deadline.tzinfo is not None and a.deadline.replace(tzinfo=None) == row.deadline
            assert a.recipe.seed == job.spec["seed"] + a.assignment_id and a.recipe.model == job.model_config_
    assert sorted(a.shard_index for a in given) == sorted({a.shard_index for a in given}), "three distinct shards"


def test_a_scheduler_worker_killed_in_the_middle_of_claims_loses_nothing_and_gives_nothing_twice(
    make_cluster, postgres_url
) -> None:
    """40 hosts ask for work back to back while one of the 3 scheduler workers is SIGKILLed. A claim
    the dead worker had committed but never answered is an assignment no host knows of: it must time
    out and its workunit be dispatched again. At no time is a workunit held by two assignments, and
    every assignment a host was told of is in the ledger."""
    cluster = make_cluster(postgres_url, server_workers=3)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.dataset.subsets = 150
    spec.stop.max_epochs = 50
    spec.scheduling.deadline_seconds = 6  # an orphaned assignment times out soon
    spec.scheduling.duplicate_after_seconds = None
    with cluster.admin() as http:
        job_id = http.post("/v1/jobs", json=spec.model_dump(mode="json")).json()["job_id"]
    tokens = register_hosts(cluster, 40)
    told: dict[int, int] = {}  # assignment id -> workunit id, as the hosts were told
    failures: list[str] = []
    cut: list[str] = []  # requests the killed worker never answered
    stop = threading.Event()

    def ask(token: str) -> None:
        while not stop.is_set():
            try:
                with httpx.Client(base_url=cluster.url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as c:
                    while not stop.is_set():
                        resp = c.post("/v1/work", json={"free_slots": 1})
                        if resp.status_code != 200:
                            failures.append(f"{resp.status_code} {resp.text[:200]}")
                            continue
                        for a in resp.json()["assignments"]:
                            told[a["assignment_id"]] = a["workunit_id"]
            except httpx.TransportError as exc:  # the worker serving this connection died
                cut.append(type(exc).__name__)

    threads = [threading.Thread(target=ask, args=(t,)) for t in tokens]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(told) >= 30, 60, "no work was dispatched")
        victim = cluster.scheduler_workers()[0]
        os.kill(victim, signal.SIGKILL)
        dispatched_at_kill = len(told)
        wait_for(lambda: len(told) >= dispatched_at_kill + 30, 60, "no work was dispatched after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:3]

    db = session_factory(postgres_url)

    def ledger() -> tuple[dict[int, str], dict[int, list[int]]]:
        with db.begin() as s:
            wus = dict(s.execute(select(Workunit.id, Workunit.status).where(Workunit.job_id == job_id)).all())
            live: dict[int, list[int]] = {}
            for a_id, wu_id in s.execute(
                select(Assignment.id, Assignment.workunit_id).where(
                    Assignment.job_id == job_id, Assignment.status == AssignmentStatus.in_progress.value
                )
            ):
                live.setdefault(wu_id, []).append(a_id)
        return wus, live

    wus, live = ledger()
    assert all(len(held) == 1 for held in live.values()), "a workunit held by two assignments"
    assert {wu for wu, st in wus.items() if st == WorkunitStatus.in_progress.value} == set(live)
    with db.begin() as s:
        recorded = dict(
            s.execute(select(Assignment.id, Assignment.workunit_id).where(Assignment.job_id == job_id)).all()
        )
    # Every assignment a host was told of is the ledger's, for that workunit (some may have timed out
    # already on a slow machine: their deadline is 6 s).
    assert {a: recorded.get(a) for a in told} == told, "a host was told of an assignment the ledger does not hold"
    held_ids = {a for held in live.values() for a in held}
    orphans = held_ids - set(told)
    print(f"{len(told)} assignments told; {len(cut)} requests cut by the kill, {len(orphans)} of them committed")
    # No host heartbeats here: every assignment, the orphans with the rest, times out at its deadline,
    # and every workunit is ready to be dispatched again: none is left held by an assignment nobody runs.
    wait_for(lambda: not ledger()[1], 60, "assignments were never timed out")
    wus, _ = ledger()
    assert set(wus.values()) == {WorkunitStatus.ready.value}, wus
    with db.begin() as s:
        assert {s.get_one(Assignment, a).status for a in held_ids | set(told)} == {AssignmentStatus.timed_out.value}
    with httpx.Client(base_url=cluster.url, timeout=30, headers={"Authorization": f"Bearer {tokens[0]}"}) as c:
        assert c.post("/v1/work", json={"free_slots": 1}).json()["assignments"], "the workunits are dispatched again"


def test_a_work_request_is_one_transaction_of_four_statements(scheduler) -> None:
    """The common case of the scheduler's most frequent call: the host's row with the running jobs,
    one claim, the claimed shard, one insert of the assignment; no pre-ping, no second transaction.
    Each statement more is a round trip and CPU on both sides of it."""
    spec = load_job_spec(EXAMPLE_SPEC)
    created = scheduler.http.post("/v1/jobs", json=spec.model_dump(mode="json"), headers=scheduler.admin_headers)
    assert created.status_code == 201, created.text
    host = scheduler.register_host()
    assert len(scheduler.http.post("/v1/work", json={"free_slots": 1}, headers=host).json()["assignments"]) == 1

    engine = scheduler.db.kw["bind"]
    seen: list[str] = []

    def note(_conn, _cursor, statement, *_):
        seen.append(statement.split(None, 1)[0].upper())

    def note_commit(_conn) -> None:
        seen.append("COMMIT")

    event.listen(engine, "before_cursor_execute", note)
    event.listen(engine, "commit", note_commit)
    try:
        reply = scheduler.http.post("/v1/work", json={"free_slots": 1}, headers=host)
    finally:
        event.remove(engine, "before_cursor_execute", note)
        event.remove(engine, "commit", note_commit)

    assert len(reply.json()["assignments"]) == 1
    assert seen == ["BEGIN", "SELECT", "UPDATE", "SELECT", "INSERT", "COMMIT"]
