"""The API's contract for requests about things that do not exist (404) or whose state does not allow
them (409), and for callers who may not do them (403): each answers ErrorOut naming the thing, and
changes nothing stored."""

import pytest

from crowdtrain.core.states import AssignmentStatus, JobStatus
from tests.server.api.conftest import World, dedloc_spec
from tests.server.inprocess import ok

MISSING = 987654


def _refused(world: World, client, method: str, path: str, code: int, words: str, **kwargs) -> None:
    before = world.fingerprint()
    resp = client.request(method, path, **kwargs)
    assert resp.status_code == code, resp.text
    assert words in resp.json()["detail"], resp.json()
    assert world.fingerprint() == before


# (caller, method, path, the words the detail must hold); the caller is "admin" or "alice" (a host)
UNKNOWN = [
    ("admin", "POST", f"/v1/admin/join-tokens/{MISSING}/revoke", f"join token {MISSING} does not exist"),
    ("admin", "POST", f"/v1/admin/hosts/{MISSING}/revoke", f"host {MISSING} does not exist"),
    ("admin", "GET", f"/v1/jobs/{MISSING}", f"job {MISSING} does not exist"),
    ("admin", "POST", f"/v1/jobs/{MISSING}/cancel", f"job {MISSING} does not exist"),
    ("admin", "GET", f"/v1/jobs/{MISSING}/model", f"job {MISSING} does not exist"),
    ("admin", "GET", f"/v1/jobs/{MISSING}/problems", f"job {MISSING} does not exist"),
    ("admin", "GET", f"/v1/jobs/{MISSING}/recipe", f"job {MISSING} does not exist"),
    ("alice", "POST", f"/v1/assignments/{MISSING}/heartbeat", f"assignment {MISSING} does not exist"),
    ("alice", "POST", f"/v1/assignments/{MISSING}/start", f"assignment {MISSING} does not exist"),
    ("alice", "POST", f"/v1/assignments/{MISSING}/abandon", f"assignment {MISSING} does not exist"),
    ("alice", "PUT", f"/v1/assignments/{MISSING}/result", f"assignment {MISSING} does not exist"),
    ("alice", "GET", f"/v1/shards/{MISSING}", f"shard {MISSING} does not exist"),
    ("alice", "GET", f"/v1/jobs/1/snapshots/{MISSING}", f"snapshot v{MISSING} of job 1 does not exist"),
    ("alice", "POST", f"/v1/dedloc/jobs/{MISSING}/join", f"job {MISSING} does not exist"),
    ("alice", "GET", f"/v1/dedloc/jobs/{MISSING}/states/latest", f"DeDLOC state of job {MISSING} does not exist"),
]


@pytest.mark.parametrize(("caller", "method", "path", "words"), UNKNOWN)
def test_an_unknown_id_is_a_404_naming_it(world: World, caller, method, path, words) -> None:
    client = world.sched.admin() if caller == "admin" else world.alice
    body = {"content": b"x"} if method == "PUT" else {"json": {}} if method == "POST" else {}
    _refused(world, client, method, path, 404, words, **body)


def test_an_error_report_about_an_unknown_assignment_is_a_404(world: World) -> None:
    _refused(
        world, world.alice, "POST", f"/v1/assignments/{MISSING}/error", 404, "does not exist", json={"message": "boom"}
    )


def test_another_hosts_assignment_is_reported_like_a_missing_one(world: World) -> None:
    a = world.assignment["assignment_id"]
    for method, action in (("POST", "heartbeat"), ("POST", "start"), ("POST", "abandon"), ("PUT", "result")):
        _refused(
            world,
            world.bob,
            method,
            f"/v1/assignments/{a}/{action}",
            404,
            f"assignment {a} does not exist or is not yours",
            content=b"x" if method == "PUT" else None,
        )


def test_an_unknown_store_operation_is_a_404_naming_the_known_ones(world: World) -> None:
    _refused(
        world,
        world.alice,
        "POST",
        f"/v1/dedloc/jobs/{world.dedloc_job}/rounds/0/0/store/format",
        404,
        "known: set, get, add, check, compare_set, delete",
        json={"peer_id": world.peer_id},
    )


def test_the_model_of_a_running_job_is_a_409(world: World) -> None:
    _refused(
        world,
        world.sched.admin(),
        "GET",
        f"/v1/jobs/{world.vc_job}/model",
        409,
        f"job {world.vc_job} has no final model yet",
    )


def test_joining_a_vc_asgd_job_as_a_dedloc_peer_is_a_409(world: World) -> None:
    _refused(
        world,
        world.bob,
        "POST",
        f"/v1/dedloc/jobs/{world.vc_job}/join",
        409,
        f"job {world.vc_job} runs in mode 'vc-asgd', not 'dedloc'",
        json={},
    )


def test_a_round_that_is_not_running_is_a_409(world: World) -> None:
    _refused(
        world,
        world.alice,
        "POST",
        f"/v1/dedloc/jobs/{world.dedloc_job}/rounds/0/0/store/set",
        409,
        "is not running",
        json={"peer_id": world.peer_id, "key": "k", "value": "eA=="},
    )


def test_a_peer_of_another_host_is_a_403(world: World) -> None:
    _refused(
        world,
        world.bob,
        "POST",
        f"/v1/dedloc/jobs/{world.dedloc_job}/progress",
        403,
        "has not joined",
        json={"peer_id": "nobody", "step": 0},
    )
    _refused(
        world,
        world.bob,
        "POST",
        f"/v1/dedloc/jobs/{world.dedloc_job}/progress",
        403,
        "belongs to another host",
        json={"peer_id": world.peer_id, "step": 0},
    )


def test_a_state_from_a_peer_that_committed_nothing_is_a_403(world: World) -> None:
    _refused(
        world,
        world.alice,
        "PUT",
        f"/v1/dedloc/jobs/{world.dedloc_job}/states/1?peer_id={world.peer_id}",
        403,
        "did not commit step 0",
        content=b"x",
    )


def test_an_assignment_given_back_cannot_be_given_back_or_uploaded_again(world: World) -> None:
    carol = world.sched.register("carol")
    a = ok(carol.post("/v1/work", json={"free_slots": 1})).json()["assignments"][0]["assignment_id"]
    given_back = ok(carol.post(f"/v1/assignments/{a}/abandon")).json()
    assert given_back == {"assignment_id": a, "status": AssignmentStatus.abandoned}
    _refused(world, carol, "POST", f"/v1/assignments/{a}/abandon", 409, f"assignment {a} is abandoned")
    _refused(
        world,
        carol,
        "POST",
        f"/v1/assignments/{a}/error",
        409,
        f"assignment {a} is abandoned",
        json={"message": "late"},
    )
    _refused(world, carol, "PUT", f"/v1/assignments/{a}/result", 409, f"assignment {a} is abandoned", content=b"late")
    assert carol.post(f"/v1/assignments/{a}/heartbeat").json() == {
        "keep_going": False,
        "reason": "assignment is abandoned",
        "deadline": None,
    }


def test_a_cancelled_job_cannot_be_cancelled_again(world: World) -> None:
    admin = world.sched.admin()
    job_id = ok(admin.post("/v1/jobs", json=dedloc_spec())).json()["job_id"]
    assert ok(admin.post(f"/v1/jobs/{job_id}/cancel")).json() == {"job_id": job_id, "status": "cancelled"}
    _refused(world, admin, "POST", f"/v1/jobs/{job_id}/cancel", 409, "cannot go from cancelled to cancelled")
    _refused(world, world.bob, "POST", f"/v1/dedloc/jobs/{job_id}/join", 409, f"job {job_id} is not running", json={})


def test_answers_say_statuses_as_the_status_enums_values(world: World) -> None:
    admin = world.sched.admin()
    listed = {j["job_id"]: j for j in ok(admin.get("/v1/jobs")).json()}
    assert {k: v for k, v in listed[world.vc_job].items() if k != "created_at"} == {
        "job_id": world.vc_job,
        "name": "mnist1d-cnn",
        "status": JobStatus.running,
        "current_epoch": 1,
        "mode": "vc-asgd",
        "max_epochs": 40,
        "accuracy": None,
    }
    status = ok(admin.get(f"/v1/jobs/{world.vc_job}")).json()
    assert status["status"] == "running" and set(status["assignments"]) <= set(AssignmentStatus)
    assert ok(world.sched.client().get("/v1/health/live")).json() == {"status": "ok"}
    assert ok(admin.get(f"/v1/dedloc/jobs/{world.dedloc_job}/commits")).json() == {}
