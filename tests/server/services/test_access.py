"""Who may read what: a host reads only the shards and snapshots its running assignments need, and
the data of the DeDLOC collaborations it joined; everything else answers like a missing object."""

import hashlib
from pathlib import Path

import pytest
import redis

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import free_port, start_redis
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, scheduler_app


def _dedloc_spec() -> dict:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json", exclude_none=True)
    data.pop("assimilation")
    return data | {
        "mode": "dedloc",
        "stop": {"target_accuracy": 0.9, "max_steps": 10},
        "dedloc": {"target_batch_size": 64, "micro_batch_size": 16},
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One scheduler with a VC-ASGD job and a DeDLOC job; alice holds an assignment of the first and
    has joined the second, bob has neither."""
    tmp: Path = tmp_path_factory.mktemp("access")
    port = free_port()
    redis_svc = start_redis(tmp / "redis", port)
    try:
        with scheduler_app(tmp / "var", redis.Redis(port=port)) as sched:
            with sched.admin() as admin:
                vc_job = ok(admin.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))).json()
                dedloc_job = ok(admin.post("/v1/jobs", json=_dedloc_spec())).json()["job_id"]
            alice, bob = sched.register("alice"), sched.register("bob")
            work = ok(alice.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
            assert len(work) == 1
            joined = ok(alice.post(f"/v1/dedloc/jobs/{dedloc_job}/join", json={})).json()
            yield {
                "sched": sched,
                "alice": alice,
                "bob": bob,
                "vc_job": vc_job["job_id"],
                "assignment": work[0],
                "dedloc_job": dedloc_job,
                "dedloc_shard": joined["shards"][0],
                "redis": redis.Redis(port=port),
            }
    finally:
        redis_svc.stop()


def _urls(w) -> dict[str, tuple[str, str | None]]:
    a = w["assignment"]
    return {
        "assigned shard": (a["shard"]["url"], a["shard"]["sha256"]),
        "assigned snapshot": (a["snapshot"]["url"], a["snapshot"]["sha256"]),
        "dedloc shard": (f"/v1/shards/{w['dedloc_shard']['id']}", w["dedloc_shard"]["sha256"]),
        "dedloc state": (f"/v1/dedloc/jobs/{w['dedloc_job']}/states/latest", None),
    }


@pytest.mark.parametrize("what", ["assigned shard", "assigned snapshot", "dedloc shard", "dedloc state"])
def test_the_host_that_needs_a_file_reads_it_and_no_other_host_does(world, what) -> None:
    url, sha = _urls(world)[what]
    assert url.startswith("/v1/"), "file storage cannot presign: the scheduler serves the file"
    mine = world["alice"].get(url)
    assert mine.status_code == 200, mine.text
    if sha is not None:
        assert hashlib.sha256(mine.content).hexdigest() == sha
    theirs = world["bob"].get(url)
    assert theirs.status_code == 404 and "does not exist" in theirs.json()["detail"], theirs.text
    assert not theirs.content.startswith(mine.content[:64])
    assert world["sched"].client().get(url).status_code == 401  # no token
    assert world["sched"].admin().get(url).status_code == 401  # the admin token is no host token


def test_another_shard_or_snapshot_of_the_same_job_is_refused_like_a_missing_one(world) -> None:
    alice, a = world["alice"], world["assignment"]
    vc_job, base = world["vc_job"], a["base_version"]
    refused = {
        "unassigned shard": f"/v1/shards/{_unassigned_shard_id(world)}",
        "missing shard": "/v1/shards/987654",
        "other version": f"/v1/jobs/{vc_job}/snapshots/{base + 1}",
        "missing job": f"/v1/jobs/987654/snapshots/{base}",
        "state of a job not joined": f"/v1/dedloc/jobs/{vc_job}/states/latest",
    }
    for name, url in refused.items():
        resp = alice.get(url)
        assert resp.status_code == 404 and "does not exist" in resp.text, (name, resp.status_code, resp.text)


def _unassigned_shard_id(w) -> int:
    assigned = int(w["assignment"]["shard"]["url"].rsplit("/", 1)[1])
    return assigned + 1 if assigned + 1 != w["dedloc_shard"]["id"] else assigned - 1


def test_a_file_is_readable_only_while_its_assignment_runs(world) -> None:
    sched = world["sched"]
    carol = sched.register("carol")
    a = ok(carol.post("/v1/work", json={"free_slots": 1})).json()["assignments"][0]
    assert carol.get(a["shard"]["url"]).status_code == 200
    assert carol.post(f"/v1/assignments/{a['assignment_id']}/heartbeat").json()["keep_going"] is True
    ok(carol.post(f"/v1/assignments/{a['assignment_id']}/abandon"))
    assert carol.get(a["shard"]["url"]).status_code == 404
    assert carol.get(a["snapshot"]["url"]).status_code == 404
