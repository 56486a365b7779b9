"""Late snapshot binding (scheduling.snapshot_binding "start"): when a host's compute slot starts an
assignment, POST /v1/assignments/{id}/start names the snapshot it trains from, and the scheduler
records it as the assignment's base, against which its upload is decoded and its staleness counted.
In-process: the app on a SQLite file and a private Redis; a parameter server's publication of a new
snapshot is the ledger's own procedure (crowdtrain.server.ledger.merges.record_snapshot)."""

import hashlib
from pathlib import Path

import pytest
from sqlalchemy import select

from crowdtrain.core import keys
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.storage import open_storage
from crowdtrain.server.ledger.merges import record_snapshot
from crowdtrain.server.ledger.models import Assignment, Workunit
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import Scheduler, ok, private_scheduler


def _submit(sched: Scheduler, binding: str | None, **validation) -> int:
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    if binding is not None:
        spec["scheduling"]["snapshot_binding"] = binding
    spec["validation"] = {**spec.get("validation", {}), **validation}
    return ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]


def _publish(sched: Scheduler, job_id: int, version: int) -> str:
    """A parameter server publishes snapshot `version`: v0's size, its last byte changed `version` times."""
    storage = open_storage(sched.settings.storage_url)
    v0 = storage.get(keys.snapshot_key(job_id, 0))
    body = v0[:-1] + bytes([(v0[-1] + version) % 256])
    key = keys.snapshot_key(job_id, version)
    storage.put(key, body)
    sha = hashlib.sha256(body).hexdigest()
    assert record_snapshot(sched.db, job_id, version, key, sha)
    return sha


def _bases(sched: Scheduler) -> dict[int, int]:
    with sched.db.begin() as s:
        return {aid: base for aid, base in s.execute(select(Assignment.id, Assignment.base_version))}


@pytest.fixture
def sched(tmp_path: Path):
    with private_scheduler(tmp_path) as sched:
        yield sched


def test_a_slot_start_binds_the_newest_snapshot_and_the_host_may_read_it(sched: Scheduler) -> None:
    job_id = _submit(sched, "start")
    host = sched.register("alice")
    first, second = ok(host.post("/v1/work", json={"free_slots": 2})).json()["assignments"]
    assert first["bind_at_start"] and first["base_version"] == second["base_version"] == 0
    sha = _publish(sched, job_id, 1)

    bound = ok(host.post(f"/v1/assignments/{first['assignment_id']}/start")).json()
    assert bound["base_version"] == 1 and bound["snapshot"]["sha256"] == sha
    body = ok(host.get(bound["snapshot"]["url"])).content
    assert hashlib.sha256(body).hexdigest() == sha and len(body) == bound["snapshot"]["size"]
    assert _bases(sched) == {first["assignment_id"]: 1, second["assignment_id"]: 0}  # the other waits for its slot

    again = ok(host.post(f"/v1/assignments/{first['assignment_id']}/start")).json()
    assert again == bound  # an answer lost on the way is given again while no newer snapshot exists
    _publish(sched, job_id, 2)
    assert ok(host.post(f"/v1/assignments/{first['assignment_id']}/start")).json()["base_version"] == 2
    assert _bases(sched)[first["assignment_id"]] == 2  # the last answer is what the scheduler recorded


def test_a_job_that_binds_at_dispatch_keeps_the_dispatched_snapshot(sched: Scheduler) -> None:
    job_id = _submit(sched, None)
    host = sched.register("alice")
    (a,) = ok(host.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
    assert a["bind_at_start"] is False
    _publish(sched, job_id, 1)
    bound = ok(host.post(f"/v1/assignments/{a['assignment_id']}/start")).json()
    assert bound == {"base_version": 0, "snapshot": None}
    assert _bases(sched) == {a["assignment_id"]: 0}


def test_replicated_work_keeps_its_dispatched_snapshot(sched: Scheduler) -> None:
    """Replicas are compared with each other: they train from the snapshot each was dispatched with."""
    job_id = _submit(sched, "start", replication=1.0)
    host = sched.register("alice")
    (a,) = ok(host.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
    with sched.db.begin() as s:
        assert s.get_one(Workunit, a["workunit_id"]).quorum == 2
    _publish(sched, job_id, 1)
    bound = ok(host.post(f"/v1/assignments/{a['assignment_id']}/start")).json()
    assert bound == {"base_version": 0, "snapshot": None}


def test_start_is_refused_for_anothers_or_an_ended_assignment_and_changes_nothing(sched: Scheduler) -> None:
    job_id = _submit(sched, "start")
    alice, bob = sched.register("alice"), sched.register("bob")
    (a,) = ok(alice.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
    _publish(sched, job_id, 1)
    before = sched.rows()
    theirs = bob.post(f"/v1/assignments/{a['assignment_id']}/start")
    assert theirs.status_code == 404 and "is not yours" in theirs.json()["detail"]
    assert sched.client().post(f"/v1/assignments/{a['assignment_id']}/start").status_code == 401
    assert sched.rows() == before
    ok(alice.post(f"/v1/assignments/{a['assignment_id']}/abandon"))
    ended = alice.post(f"/v1/assignments/{a['assignment_id']}/start")
    assert ended.status_code == 409 and "not training" in ended.json()["detail"], ended.text
    assert _bases(sched) == {a["assignment_id"]: 0}
