"""Uploads of a job whose clients send their update Δ as int8 (assimilation.upload): a body that does
not match the announced encoding gets a 4xx naming the problem and changes nothing; a good one is
stored and merged as W_c = W_base + Δ."""

import time

import httpx
import numpy as np
import pytest
import redis
from safetensors.numpy import save

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.tensors import decode, encode, manifest_of
from crowdtrain.core.updates import SCALE_SUFFIX, decode_update, encode_result, encode_update
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment
from crowdtrain.server.paramstore import merging, store
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
UPLOAD = {"send": "delta", "dtype": "int8", "block_size": 64}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A cluster (no clients) with the example job sending int8 deltas; one host and its W_base."""
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["assimilation"] = {"rule": "vc-asgd", "alpha": 0.6, "upload": UPLOAD}  # the merge checked below
    spec["scheduling"].update(max_errors=100, deadline_seconds=600)
    spec["validation"] = {"quarantine_after": None}  # one host sends every refused body
    cluster = Cluster(var_dir=tmp_path_factory.mktemp("delta-uploads")).start()
    try:
        with cluster.admin() as http:
            resp = http.post("/v1/jobs", json=spec)
            assert resp.status_code == 201, resp.text
            job_id = resp.json()["job_id"]
        token = httpx.post(f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": "alice"}).json()[
            "host_token"
        ]
        with httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as host:
            yield cluster, job_id, host
    finally:
        cluster.stop()


def _assignment(host: httpx.Client) -> tuple[dict, dict]:
    a = host.post("/v1/work", json={"free_slots": 1}).json()["assignments"][0]
    return a, decode(host.get(a["snapshot"]["url"]).content)


def _trained(base: dict) -> dict:
    rng = np.random.default_rng(1)
    return {
        k: v + (0.01 * rng.normal(size=v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in base.items()
    }


def _state(cluster: Cluster, job_id: int, assignment_id: int) -> tuple[int, str, list]:
    r = redis.Redis.from_url(cluster.redis_url)
    version, _ = store.read_blob(r, job_id)
    with session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}").begin() as s:
        status = s.get_one(Assignment, assignment_id).status
    uploads = list((cluster.var_dir / "storage" / "jobs" / str(job_id)).glob("uploads/*"))
    return version, status, uploads


def _bad_body(kind: str, base: dict) -> bytes:
    client = _trained(base)
    if kind == "weights":
        return encode(client)
    wire = {
        **{k: v for k, v in client.items() if v.dtype.kind != "f"},
        **encode_update({k: client[k] - v for k, v in base.items() if v.dtype.kind == "f"}, UPLOAD),
    }
    name = next(k for k in base if k + SCALE_SUFFIX in wire and wire[k].size > 64)
    if kind == "float32 tensor":
        wire[name] = client[name] - base[name]
    elif kind == "NaN scale":
        wire[name + SCALE_SUFFIX][0] = np.nan
    elif kind == "wrong block count":
        wire[name + SCALE_SUFFIX] = wire[name + SCALE_SUFFIX][:-1]
    return save({k: np.ascontiguousarray(v).reshape(v.shape) for k, v in wire.items()})


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("float32 tensor", "has dtype float32, expected int8"),
        ("weights", "missing ["),
        ("NaN scale", "scale that is negative, NaN or infinite"),
        ("wrong block count", ".__scale__' has shape"),
    ],
)
def test_a_body_that_is_not_the_announced_encoding_is_refused_and_changes_nothing(setup, kind, words) -> None:
    cluster, job_id, host = setup
    a, base = _assignment(host)
    resp = host.put(f"/v1/assignments/{a['assignment_id']}/result", content=_bad_body(kind, base))
    assert resp.status_code == 422, resp.text
    assert words in resp.json()["detail"] and "delta/int8/block64" in resp.json()["detail"]
    assert _state(cluster, job_id, a["assignment_id"]) == (0, "rejected", [])


def test_a_good_int8_delta_is_stored_and_merged_as_base_plus_delta(setup) -> None:
    """With vc-asgd (alpha 0.6), W_s v1 = 0.6 W_base + 0.4 (W_base + Δ̂), Δ̂ the decoded int8 update."""
    cluster, job_id, host = setup
    a, base = _assignment(host)
    assert a["recipe"]["upload"] == UPLOAD
    body = encode_result(_trained(base), base, a["recipe"]["upload"])
    resp = host.put(f"/v1/assignments/{a['assignment_id']}/result", content=body)
    assert resp.status_code == 202, resp.text
    r = redis.Redis.from_url(cluster.redis_url)
    deadline = time.monotonic() + 60
    while merging.merged_version(r, job_id, a["assignment_id"]) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert merging.merged_version(r, job_id, a["assignment_id"]) == 1
    _, merged = store.read(r, job_id)
    delta = decode_update(body, manifest_of(base), UPLOAD)
    for name, w in base.items():
        expected = 0.6 * w + 0.4 * (w + delta[name]) if w.dtype.kind == "f" else delta[name]
        np.testing.assert_allclose(merged[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)
