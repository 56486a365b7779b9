"""Bad uploads get a 4xx that says what is wrong, and leave W_s, the assignment and storage alone."""

import time

import httpx
import numpy as np
import pytest
import redis

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.tensors import decode, encode
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Workunit
from crowdtrain.server.paramstore import merging, store
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
LIMIT = 1_000_000


def _spec() -> dict:
    """The example job, where one charged failure fails a workunit and no deadline passes during the tests."""
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["scheduling"].update(max_errors=1, deadline_seconds=600)
    spec["validation"] = {"quarantine_after": None}  # one host sends every refused body
    return spec


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    var = tmp_path_factory.mktemp("uploads")
    cluster = Cluster(var_dir=var, extra_env={"CROWDTRAIN_UPLOAD_MAX_BYTES": str(LIMIT)}).start()
    try:
        with cluster.admin() as http:
            job_id = http.post("/v1/jobs", json=_spec()).json()["job_id"]
        hosts = {}
        for name in ("alice", "mallory"):
            token = httpx.post(f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": name}).json()[
                "host_token"
            ]
            hosts[name] = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        first = hosts["alice"].post("/v1/work", json={"free_slots": 1}).json()["assignments"][0]
        snapshot = decode(hosts["alice"].get(first["snapshot"]["url"]).content)
        hosts["alice"].post(f"/v1/assignments/{first['assignment_id']}/abandon").raise_for_status()
        yield cluster, job_id, hosts, snapshot
    finally:
        cluster.stop()


@pytest.fixture
def work(setup) -> dict:
    """A fresh assignment of alice's for each case."""
    _, _, hosts, _ = setup
    return hosts["alice"].post("/v1/work", json={"free_slots": 1}).json()["assignments"][0]


def _db(cluster):
    return session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")


def _state(cluster, job_id: int, assignment_id: int) -> tuple[int, str, list]:
    r = redis.Redis.from_url(cluster.redis_url)
    version, _ = store.read_blob(r, job_id)
    with _db(cluster).begin() as s:
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


@pytest.mark.parametrize(
    ("kind", "status", "words"),
    [
        ("not safetensors", 422, "not a safetensors"),
        ("wrong name", 422, "names"),
        ("wrong shape", 422, "shape"),
        ("wrong dtype", 422, "dtype"),
        ("NaN", 422, "NaN"),
        ("too large", 413, "limit"),
    ],
)
def test_a_bad_body_is_refused_and_its_workunit_goes_back_at_once(
    setup, work, kind: str, status: int, words: str
) -> None:
    """The assignment ends rejected (charged to the host) instead of waiting for its deadline; with
    max_errors=1 its workunit fails at once. W_s and storage are untouched."""
    cluster, job_id, hosts, snapshot = setup
    aid = work["assignment_id"]
    resp = hosts["alice"].put(f"/v1/assignments/{aid}/result", content=_variant(snapshot, kind))
    assert resp.status_code == status, resp.text
    assert words in resp.json()["detail"]
    assert _state(cluster, job_id, aid) == (0, "rejected", [])
    with _db(cluster).begin() as s:
        a = s.get_one(Assignment, aid)
        wu = s.get_one(Workunit, a.workunit_id)
        assert (wu.status, wu.error_count) == ("failed", 1)
        assert words in a.message


def test_an_epoch_whose_uploads_are_all_refused_closes_without_waiting(setup) -> None:
    """Once every workunit of epoch 1 has failed on a refused upload, epoch 1 is over and epoch 2 begins.
    The bad-body cases above fail some of them when they ran on this worker first (the module's
    cluster is one per xdist worker); the rest are failed here."""
    cluster, job_id, hosts, snapshot = setup

    def first_epoch() -> dict:
        with cluster.admin() as http:
            epochs = http.get(f"/v1/jobs/{job_id}").json()["epochs"]
        return next(e for e in epochs if e["epoch"] == 1)

    for _ in range(first_epoch()["workunits"]):
        if first_epoch()["failed"] == first_epoch()["workunits"]:
            break
        aid = hosts["alice"].post("/v1/work", json={"free_slots": 1}).json()["assignments"][0]["assignment_id"]
        resp = hosts["alice"].put(f"/v1/assignments/{aid}/result", content=_variant(snapshot, "NaN"))
        assert resp.status_code == 422, resp.text
    first = first_epoch()
    assert (first["failed"], first["done"], first["workunits"]) == (4, 0, 4)
    with cluster.admin() as http:
        assert any(e["epoch"] == 2 for e in http.get(f"/v1/jobs/{job_id}").json()["epochs"])


def test_unknown_and_foreign_assignments_are_not_found(setup, work) -> None:
    cluster, job_id, hosts, snapshot = setup
    body = encode(snapshot)
    unknown = hosts["alice"].put("/v1/assignments/999999/result", content=body)
    foreign = hosts["mallory"].put(f"/v1/assignments/{work['assignment_id']}/result", content=body)
    anonymous = hosts["alice"].put(
        f"/v1/assignments/{work['assignment_id']}/result", content=body, headers={"Authorization": ""}
    )
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["detail"]
    assert foreign.status_code == 404 and "not yours" in foreign.json()["detail"]
    assert anonymous.status_code == 401
    assert _state(cluster, job_id, work["assignment_id"]) == (0, "in_progress", [])
    hosts["alice"].post(f"/v1/assignments/{work['assignment_id']}/abandon").raise_for_status()


def test_a_result_is_accepted_once(setup, work) -> None:
    cluster, job_id, hosts, snapshot = setup
    aid = work["assignment_id"]
    rng = np.random.default_rng(0)  # W_base moved a little: W_base itself is refused (no training)
    result = encode(
        {
            k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in snapshot.items()
        }
    )
    first = hosts["alice"].put(f"/v1/assignments/{aid}/result", content=result)
    assert first.status_code == 202, first.text
    r = redis.Redis.from_url(cluster.redis_url)
    deadline = time.monotonic() + 60
    while merging.merged_version(r, job_id, aid) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert merging.merged_version(r, job_id, aid) == 1
    again = hosts["alice"].put(f"/v1/assignments/{aid}/result", content=result)
    assert again.status_code == 409 and "once" in again.json()["detail"]
    time.sleep(1)
    assert store.read_blob(r, job_id)[0] == 1


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        ({"dataset": {"source": "npz:/nonexistent.npz", "subsets": 2}}, "does not exist"),
        ({"model": {"name": "transformer"}}, "model"),
        ({"stop": {"target_accuracy": 1.5}}, "target_accuracy"),
        ({"model": {"name": "cnn1d", "options": {"wings": 2}}}, "wings"),
    ],
)
def test_a_bad_job_spec_is_refused_and_creates_no_job(setup, patch: dict, words: str) -> None:
    cluster, *_ = setup
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | patch
    with cluster.admin() as http:
        before = http.get("/v1/jobs").json()
        resp = http.post("/v1/jobs", json=spec)
        assert resp.status_code == 422, resp.text
        assert words in resp.text
        assert http.get("/v1/jobs").json() == before
