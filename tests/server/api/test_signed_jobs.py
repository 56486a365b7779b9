"""Signed work through the API: with a project key the scheduler holds a job until the operator's
signature of its recipe verifies (a bad one is 422 and changes nothing), then sends the signed recipe
with every assignment; the key changes only by a rotation statement signed with the key in use."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from crowdtrain.client.trust import WorkRefused, check_peer_recipe, initial_state_sha256
from crowdtrain.core import signing
from crowdtrain.core.schemas_dedloc import PeerJoined
from crowdtrain.core.tensors import sha256
from tests.server.api.conftest import dedloc_spec
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


def test_a_signed_dedloc_job_carries_its_recipe_to_peers_and_shows_a_peers_refusal(sched: Scheduler) -> None:
    """Submission signs a DeDLOC job like any other: its recipe covers what a peer runs, a joining peer
    gets it signed and checks it (crowdtrain.client.trust), and a refusal leaves the collaboration and
    is in the job's problems."""
    admin = sched.admin()
    key = ok(admin.get("/v1/admin/project-key")).json()["public_key"]
    signer = {PUB_A: KEY_A, PUB_B: KEY_B}.get(key)
    if signer is None:
        ok(admin.post("/v1/admin/project-key", json={"public_key": PUB_A}))
        key, signer = PUB_A, KEY_A
    created = ok(admin.post("/v1/jobs", json=dedloc_spec())).json()
    job_id, recipe = created["job_id"], created["recipe"]
    document = json.loads(recipe)
    assert (created["status"], document["mode"], document["training"]["max_steps"]) == ("pending", "dedloc", 10)
    peer = sched.register("peer")
    assert peer.post(f"/v1/dedloc/jobs/{job_id}/join", json={}).status_code == 409, "no peer before signing"
    ok(admin.post(f"/v1/jobs/{job_id}/signature", json={"signature": signing.sign(signer, recipe.encode())}))

    joined = PeerJoined.model_validate(ok(peer.post(f"/v1/dedloc/jobs/{job_id}/join", json={})).json())
    assert joined.signed is not None and joined.signed.recipe == recipe
    assert check_peer_recipe(joined, key, joined.key_rotations).pinned == key
    state = ok(peer.get(f"/v1/dedloc/jobs/{job_id}/states/latest"))
    assert sha256(state.content) == initial_state_sha256(joined) == document["initial_snapshot"]

    other = PUB_B if key != PUB_B else PUB_A
    with pytest.raises(WorkRefused, match="not by the project key") as refused:
        check_peer_recipe(joined, other, [])
    body = {"peer_id": joined.peer_id, "message": f"peer refused the job: {refused.value}"}
    assert sched.register("stranger").post(f"/v1/dedloc/jobs/{job_id}/refusal", json=body).status_code == 403
    ok(peer.post(f"/v1/dedloc/jobs/{job_id}/refusal", json=body))
    findings = ok(admin.get(f"/v1/jobs/{job_id}/problems")).json()["findings"]
    assert any(
        f"peer {joined.peer_id} refused to train this job" in f and "not by the project key" in f for f in findings
    )
    assert (
        peer.post(f"/v1/dedloc/jobs/{job_id}/progress", json={"peer_id": joined.peer_id, "step": -1}).status_code == 403
    )
    ok(admin.post(f"/v1/jobs/{job_id}/cancel"))
