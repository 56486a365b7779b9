"""Signed work through the API: with a project key the scheduler holds a job until the operator's
signature of its recipe verifies (a bad one is 422 and changes nothing), then sends the signed recipe
with every assignment; the key changes only by a rotation statement signed with the key in use."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from crowdtrain.core import signing
from tests.server.inprocess import Scheduler, ok, private_scheduler, write_small_npz


@pytest.fixture(scope="module")
def sched(tmp_path_factory) -> Iterator[Scheduler]:
    with private_scheduler(tmp_path_factory.mktemp("signed")) as app:
        yield app


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_small_npz(tmp_path_factory.mktemp("data") / "small.npz")


def spec(dataset: Path, **dataset_fields) -> dict:
    return {
        "name": "signed",
        "model": {"name": "mlp", "options": {"hidden": [8]}},
        "dataset": {"source": f"npz:{dataset}", "subsets": 3, **dataset_fields},
        "stop": {"target_accuracy": 0.99, "max_epochs": 2},
    }


KEY_A, KEY_B = signing.generate_private_key(), signing.generate_private_key()
PUB_A, PUB_B = signing.public_key_text(KEY_A), signing.public_key_text(KEY_B)


def test_signed_work_from_submission_to_rotation(sched: Scheduler, dataset: Path) -> None:
    admin = sched.admin()
    # No project key: jobs run unsigned at once, and take no signature.
    unsigned = ok(admin.post("/v1/jobs", json=spec(dataset))).json()
    assert (unsigned["status"], unsigned["signature_required"]) == ("running", False)
    refused = admin.post(f"/v1/jobs/{unsigned['job_id']}/signature", json={"signature": signing.sign(KEY_A, b"x")})
    assert refused.status_code == 409 and "no key" in refused.json()["detail"]
    ok(admin.post(f"/v1/jobs/{unsigned['job_id']}/cancel"))

    assert ok(admin.post("/v1/admin/project-key", json={"public_key": PUB_A})).json()["public_key"] == PUB_A
    assert ok(admin.post("/v1/admin/project-key", json={"public_key": PUB_A})).status_code == 200, "idempotent"
    other = admin.post("/v1/admin/project-key", json={"public_key": PUB_B})
    assert other.status_code == 409 and "rotation" in other.json()["detail"]
    assert admin.post("/v1/admin/project-key", json={"public_key": "AAAA"}).status_code == 422

    registered = ok(sched.client().post("/v1/hosts", json={"join_token": sched.settings.join_token, "name": "h"}))
    assert registered.json()["project_public_key"] == PUB_A
    host = sched.client(registered.json()["host_token"])

    created = ok(admin.post("/v1/jobs", json=spec(dataset))).json()
    job_id, recipe = created["job_id"], created["recipe"]
    assert (created["status"], created["signature_required"]) == ("pending", True)
    document = json.loads(recipe)
    assert signing.canonical_json(document) == recipe
    assert (document["job_id"], len(document["shards"]), document["model"]["name"]) == (job_id, 3, "mlp")
    assert ok(host.post("/v1/work", json={"free_slots": 4})).json()["assignments"] == [], "no work before signing"

    before = sched.rows()
    for bad in (signing.sign(KEY_B, recipe.encode()), signing.sign(KEY_A, recipe.encode() + b" "), "A" * 86 + "=="):
        answer = admin.post(f"/v1/jobs/{job_id}/signature", json={"signature": bad})
        assert answer.status_code == 422, answer.text
        assert sched.rows() == before, "a refused signature changes nothing"
    assert admin.post(f"/v1/jobs/{job_id}/signature", json={"signature": "nope"}).status_code == 422
    assert admin.post("/v1/jobs/999/signature", json={"signature": signing.sign(KEY_A, b"")}).status_code == 404

    signed = ok(admin.post(f"/v1/jobs/{job_id}/signature", json={"signature": signing.sign(KEY_A, recipe.encode())}))
    assert (signed.json()["status"], signed.json()["public_key"]) == ("running", PUB_A)
    assert ok(host.post("/v1/work", json={"free_slots": 1, "refused_jobs": [job_id]})).json()["assignments"] == []
    (a,) = ok(host.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
    assert a["signed"]["recipe"] == recipe and a["signed"]["public_key"] == PUB_A
    assert signing.verify(PUB_A, a["signed"]["recipe"].encode(), a["signed"]["signature"])
    assert a["shard"]["sha256"] in document["shards"] and a["snapshot"]["sha256"] == document["initial_snapshot"]

    # Rotation: a statement not signed by the key in use is refused, and changes nothing.
    before = sched.rows()
    forged = {"old_public_key": PUB_A, "new_public_key": PUB_B, "signature": signing.sign_rotation(KEY_B, PUB_B)}
    assert admin.post("/v1/admin/project-key/rotations", json=forged).status_code == 422
    assert sched.rows() == before
    rotation = {"old_public_key": PUB_A, "new_public_key": PUB_B, "signature": signing.sign_rotation(KEY_A, PUB_B)}
    assert ok(admin.post("/v1/admin/project-key/rotations", json=rotation)).json()["public_key"] == PUB_B
    assert admin.post("/v1/admin/project-key/rotations", json=rotation).status_code == 409, "A is no longer in use"
    # The running job keeps A's signature until the operator signs it again, with B only.
    old_again = admin.post(f"/v1/jobs/{job_id}/signature", json={"signature": signing.sign(KEY_A, recipe.encode())})
    assert old_again.status_code == 422
    ok(admin.post(f"/v1/jobs/{job_id}/signature", json={"signature": signing.sign(KEY_B, recipe.encode())}))
    reply = ok(host.post("/v1/work", json={"free_slots": 1})).json()
    assert reply["assignments"][0]["signed"]["public_key"] == PUB_B
    assert reply["key_rotations"] == [rotation]


def test_a_signed_job_cannot_reshuffle_its_shards(sched: Scheduler, dataset: Path) -> None:
    """The recipe names every shard; a re-dealt epoch's shards would be made after it is signed."""
    admin = sched.admin()
    if ok(admin.get("/v1/admin/project-key")).json()["public_key"] is None:
        ok(admin.post("/v1/admin/project-key", json={"public_key": PUB_A}))
    before = sched.rows()
    answer = admin.post("/v1/jobs", json=spec(dataset, reshuffle_each_epoch=True))
    assert answer.status_code == 422 and "reshuffle_each_epoch" in answer.json()["detail"]
    assert sched.rows() == before
