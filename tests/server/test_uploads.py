"""Bad uploads get a 4xx that says what is wrong, and leave W_s, the assignment and storage alone."""

import time

import httpx
import numpy as np
import pytest
import redis

from assimilator import paramstore
from crowdtrain.jobspec import load_job_spec
from crowdtrain.launch import Cluster
from crowdtrain.tensors import decode, encode
from server.db import session_factory
from server.models import Assignment
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
LIMIT = 1_000_000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    var = tmp_path_factory.mktemp("uploads")
    cluster = Cluster(var_dir=var, extra_env={"CROWDTRAIN_UPLOAD_MAX_BYTES": str(LIMIT)}).start()
    try:
        with cluster.admin() as http:
            job_id = http.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")).json()["job_id"]
        hosts = {}
        for name in ("alice", "mallory"):
            token = httpx.post(f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": name}
                               ).json()["host_token"]
            hosts[name] = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {token}"},
                                       timeout=60)
        work = hosts["alice"].post("/v1/work", json={"free_slots": 1}).json()["assignments"][0]
        snapshot = decode(hosts["alice"].get(work["snapshot"]["url"]).content)
        yield cluster, job_id, hosts, work, snapshot
    finally:
        cluster.stop()


def _state(cluster, job_id: int, assignment_id: int) -> tuple[int, str, list]:
    r = redis.Redis.from_url(cluster.redis_url)
    version, _ = paramstore.read_blob(r, job_id)
    with session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}").begin() as s:
        status = s.get_one(Assignment, assignment_id).status
    uploads = list((cluster.var_dir / "storage" / "jobs" / str(job_id)).glob("uploads/*"))
    return version, status, uploads


def _variant(snapshot: dict, kind: str) -> bytes:
    p = {k: v.copy() for k, v in snapshot.items()}
    name = next(k for k, v in p.items() if v.ndim == 2 or v.ndim == 3)
    if kind == "not safetensors":
        return b"\x80\x04 this is a pickle, not a safetensors file" * 10
    if kind == "wrong name":
        p["extra.weight"] = p.pop(name)
    elif kind == "wrong shape":
        p[name] = np.zeros((3, 3), np.float32)
    elif kind == "wrong dtype":
        p[name] = p[name].astype(np.float64)
    elif kind == "NaN":
        p[name].flat[0] = np.nan
    elif kind == "too large":
        return encode({**p, "padding": np.zeros(LIMIT // 4 + 10, np.float32)})
    return encode(p)


@pytest.mark.parametrize(("kind", "status", "words"), [
    ("not safetensors", 422, "not a safetensors"),
    ("wrong name", 422, "names"),
    ("wrong shape", 422, "shape"),
    ("wrong dtype", 422, "dtype"),
    ("NaN", 422, "NaN"),
    ("too large", 413, "limit"),
])
def test_a_bad_body_is_refused_and_changes_nothing(setup, kind: str, status: int, words: str) -> None:
    cluster, job_id, hosts, work, snapshot = setup
    aid = work["assignment_id"]
    before = _state(cluster, job_id, aid)
    resp = hosts["alice"].put(f"/v1/assignments/{aid}/result", content=_variant(snapshot, kind))
    assert resp.status_code == status, resp.text
    assert words in resp.json()["detail"]
    assert _state(cluster, job_id, aid) == before == (0, "in_progress", [])


def test_unknown_and_foreign_assignments_are_not_found(setup) -> None:
    cluster, job_id, hosts, work, snapshot = setup
    body = encode(snapshot)
    unknown = hosts["alice"].put("/v1/assignments/999999/result", content=body)
    foreign = hosts["mallory"].put(f"/v1/assignments/{work['assignment_id']}/result", content=body)
    anonymous = hosts["alice"].put(f"/v1/assignments/{work['assignment_id']}/result", content=body,
                                   headers={"Authorization": ""})
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["detail"]
    assert foreign.status_code == 404 and "not yours" in foreign.json()["detail"]
    assert anonymous.status_code == 401
    assert _state(cluster, job_id, work["assignment_id"]) == (0, "in_progress", [])


def test_a_result_is_accepted_once(setup) -> None:
    """Runs last in this module: the good upload is merged, the repeat is refused."""
    cluster, job_id, hosts, work, snapshot = setup
    aid = work["assignment_id"]
    first = hosts["alice"].put(f"/v1/assignments/{aid}/result", content=encode(snapshot))
    assert first.status_code == 202, first.text
    r = redis.Redis.from_url(cluster.redis_url)
    deadline = time.monotonic() + 60
    while paramstore.merged_version(r, job_id, aid) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert paramstore.merged_version(r, job_id, aid) == 1
    again = hosts["alice"].put(f"/v1/assignments/{aid}/result", content=encode(snapshot))
    assert again.status_code == 409 and "once" in again.json()["detail"]
    time.sleep(1)
    assert paramstore.read_blob(r, job_id)[0] == 1


@pytest.mark.parametrize(("patch", "words"), [
    ({"dataset": {"source": "npz:/nonexistent.npz", "subsets": 2}}, "does not exist"),
    ({"model": {"name": "transformer"}}, "model"),
    ({"stop": {"target_accuracy": 1.5}}, "target_accuracy"),
    ({"model": {"name": "cnn1d", "options": {"wings": 2}}}, "wings"),
])
def test_a_bad_job_spec_is_refused_and_creates_no_job(setup, patch: dict, words: str) -> None:
    cluster, *_ = setup
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | patch
    with cluster.admin() as http:
        before = http.get("/v1/jobs").json()
        resp = http.post("/v1/jobs", json=spec)
        assert resp.status_code == 422, resp.text
        assert words in resp.text
        assert http.get("/v1/jobs").json() == before
