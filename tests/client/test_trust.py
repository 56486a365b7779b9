"""crowdtrain.client.trust: an assignment runs only if its recipe is signed by the trusted key (or one
that rotations signed by it lead to) and it asks to train what the recipe says."""

from datetime import UTC, datetime
from pathlib import Path

import pytest

from crowdtrain.client.identity import Identities
from crowdtrain.client.trust import (
    ProjectTrust,
    WorkRefused,
    check_assignment,
    check_peer_recipe,
    initial_state_sha256,
)
from crowdtrain.core import signing
from crowdtrain.core.schemas import AssignmentOut, FileRef, KeyRotation, Recipe, SignedRecipe
from crowdtrain.core.schemas_dedloc import PeerJoined, ShardRef

MODEL = {"name": "mlp", "framework": "pytorch", "input_shape": [40], "num_classes": 10, "options": {}}
TRAINING = {"lr": 0.01, "batch_size": 32}
UPLOAD = {"send": "weights", "dtype": "float32", "block_size": None}
SHARDS = ["a" * 64, "b" * 64]
V0 = "c" * 64


def recipe_text(job_id: int = 5, **changes) -> str:
    doc = signing.recipe_document(job_id, "j", MODEL, TRAINING, UPLOAD, 100, SHARDS, V0) | changes
    return signing.canonical_json(doc)


def assignment(key=None, text: str | None = None, **changes) -> AssignmentOut:
    text = text or recipe_text()
    signed = (
        SignedRecipe(recipe=text, public_key=signing.public_key_text(key), signature=signing.sign(key, text.encode()))
        if key is not None
        else None
    )
    fields = dict(
        assignment_id=9,
        job_id=5,
        workunit_id=1,
        epoch=1,
        shard_index=0,
        base_version=0,
        deadline=datetime.now(UTC),
        recipe=Recipe(model=MODEL, training=TRAINING, seed=109, upload=UPLOAD),
        shard=FileRef(url="/v1/shards/1", sha256=SHARDS[0], size=10),
        snapshot=FileRef(url="/v1/jobs/5/snapshots/0", sha256=V0, size=10),
        signed=signed,
    )
    return AssignmentOut.model_validate(fields | changes)


@pytest.fixture
def keys():
    return signing.generate_private_key(), signing.generate_private_key()


def test_signed_work_by_the_pinned_key_runs(keys) -> None:
    a, _ = keys
    pinned = signing.public_key_text(a)
    assert check_assignment(assignment(a), pinned, []).pinned == pinned


def test_unsigned_work_runs_only_on_a_client_that_trusts_no_key(keys) -> None:
    a, _ = keys
    assert check_assignment(assignment(), None, []).pinned is None
    with pytest.raises(WorkRefused, match="unsigned"):
        check_assignment(assignment(), signing.public_key_text(a), [])


def test_the_first_key_that_signs_work_is_pinned(keys) -> None:
    a, _ = keys
    assert check_assignment(assignment(a), None, []).pinned == signing.public_key_text(a)


def test_work_signed_by_another_key_is_refused(keys) -> None:
    a, b = keys
    with pytest.raises(WorkRefused, match="not by the project key"):
        check_assignment(assignment(b), signing.public_key_text(a), [])


def test_a_rotation_signed_by_the_pinned_key_moves_the_pin(keys) -> None:
    a, b = keys
    pa, pb = signing.public_key_text(a), signing.public_key_text(b)
    rotation = KeyRotation(old_public_key=pa, new_public_key=pb, signature=signing.sign_rotation(a, pb))
    checked = check_assignment(assignment(b), pa, [rotation])
    assert (checked.pinned, checked.rotated) == (pb, True)
    forged = KeyRotation(old_public_key=pa, new_public_key=pb, signature=signing.sign_rotation(b, pb))
    with pytest.raises(WorkRefused):
        check_assignment(assignment(b), pa, [forged])


def test_a_signature_that_does_not_cover_the_recipe_is_refused(keys) -> None:
    a, _ = keys
    good = assignment(a)
    assert good.signed is not None
    tampered = good.model_copy(update={"signed": good.signed.model_copy(update={"recipe": recipe_text(seed=1)})})
    with pytest.raises(WorkRefused, match="does not verify"):
        check_assignment(tampered, signing.public_key_text(a), [])


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"job_id": 6}, "job_id"),
        ({"recipe": Recipe(model=MODEL | {"name": "cnn1d"}, training=TRAINING, seed=109, upload=UPLOAD)}, "model"),
        ({"recipe": Recipe(model=MODEL, training=TRAINING | {"lr": 1.0}, seed=109, upload=UPLOAD)}, "training"),
        ({"recipe": Recipe(model=MODEL, training=TRAINING, seed=7, upload=UPLOAD)}, "seed"),
        ({"shard": FileRef(url="/v1/shards/1", sha256="d" * 64, size=10)}, "shard"),
        ({"snapshot": FileRef(url="/v1/jobs/5/snapshots/0", sha256="e" * 64, size=10)}, "snapshot"),
    ],
)
def test_an_assignment_that_differs_from_its_signed_recipe_is_refused(keys, changes: dict, field: str) -> None:
    a, _ = keys
    with pytest.raises(WorkRefused, match=f"signed recipe in: {field}$"):
        check_assignment(assignment(a, **changes), signing.public_key_text(a), [])


def test_a_later_snapshot_is_not_checked_against_version_0(keys) -> None:
    a, _ = keys
    later = assignment(a, base_version=3, snapshot=FileRef(url="/s", sha256="e" * 64, size=10))
    check_assignment(later, signing.public_key_text(a), [])


def test_the_pin_and_refused_jobs_are_kept_with_the_registration(tmp_path: Path, keys) -> None:
    a, b = keys
    identities = Identities(tmp_path / "identity.json")
    identities.save("http://s", 1, "token", [], None)
    trust = ProjectTrust(identities, "http://s")
    trust.load(identities.get("http://s") or {})
    assert trust.check(assignment(a), []) is None, "trust on first use"
    refused = trust.check(assignment(b), [])
    assert refused is not None and "not by the project key" in refused
    again = ProjectTrust(identities, "http://s")
    again.load(identities.get("http://s") or {})
    assert (again.pinned, again.refused_jobs) == (signing.public_key_text(a), [5])


DEDLOC = {"target_batch_size": 96, "micro_batch_size": 16, "lr": 0.05}


def joined(key=None, text: str | None = None, **changes) -> PeerJoined:
    """What a DeDLOC peer is given on joining job 5, signed by `key` (unsigned if None)."""
    text = text or signing.canonical_json(
        signing.recipe_document(5, "j", MODEL, signing.dedloc_training(DEDLOC, 40), UPLOAD, 3, SHARDS, V0, "dedloc")
    )
    signed = (
        SignedRecipe(recipe=text, public_key=signing.public_key_text(key), signature=signing.sign(key, text.encode()))
        if key is not None
        else None
    )
    fields = dict(
        peer_id="h1-abcd",
        job_id=5,
        recipe={"model": MODEL, "dedloc": DEDLOC, "seed": 3, "max_steps": 40},
        shards=[ShardRef(id=i + 1, index=i, sha256=sha, size=10, examples=5) for i, sha in enumerate(SHARDS)],
        step=0,
        state_step=0,
        signed=signed,
    )
    return PeerJoined.model_validate(fields | changes)


def test_a_peer_checks_its_job_by_the_rules_of_an_assignment(keys) -> None:
    a, b = keys
    pinned = signing.public_key_text(a)
    assert check_peer_recipe(joined(a), pinned, []).pinned == pinned
    assert initial_state_sha256(joined(a)) == V0
    assert check_peer_recipe(joined(), None, []).pinned is None, "no key pinned: unsigned work runs"
    with pytest.raises(WorkRefused, match="unsigned"):
        check_peer_recipe(joined(), pinned, [])
    with pytest.raises(WorkRefused, match="not by the project key"):
        check_peer_recipe(joined(b), pinned, [])
    rotation = KeyRotation(
        old_public_key=pinned,
        new_public_key=signing.public_key_text(b),
        signature=signing.sign_rotation(a, signing.public_key_text(b)),
    )
    assert check_peer_recipe(joined(b), pinned, [rotation]).rotated


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"recipe": {"model": MODEL, "dedloc": DEDLOC | {"lr": 5.0}, "seed": 3, "max_steps": 40}}, "training"),
        ({"recipe": {"model": MODEL, "dedloc": DEDLOC, "seed": 4, "max_steps": 40}}, "seed"),
        (
            {"recipe": {"model": MODEL | {"options": {"hidden": [9]}}, "dedloc": DEDLOC, "seed": 3, "max_steps": 40}},
            "model",
        ),
        ({"shards": [ShardRef(id=1, index=0, sha256="d" * 64, size=10, examples=5)]}, "shards"),
        ({"job_id": 6}, "job_id"),
    ],
)
def test_a_peer_refuses_a_job_that_differs_from_its_signed_recipe(keys, changes, field) -> None:
    a, _ = keys
    with pytest.raises(WorkRefused, match=f"differs from its signed recipe in: {field}"):
        check_peer_recipe(joined(a, **changes), signing.public_key_text(a), [])


def test_a_peer_refused_job_is_kept_with_its_registration(keys, tmp_path: Path) -> None:
    a, b = keys
    identities = Identities(tmp_path / "identity.json")
    identities.save("http://s", 1, "t", [], signing.public_key_text(a))
    trust = ProjectTrust(identities, "http://s")
    trust.load(identities.get("http://s") or {})
    assert trust.check_peer(joined(a)) is None
    assert "not by the project key" in (trust.check_peer(joined(b)) or "")
    assert (identities.get("http://s") or {})["refused_jobs"] == [5]
    memory_only = ProjectTrust(None, "http://s", signing.public_key_text(a))
    memory_only.load({"project_public_key": signing.public_key_text(a)})
    assert memory_only.check_peer(joined()) is not None and memory_only.refused_jobs == [5]
