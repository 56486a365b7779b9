"""crowdtrain.core.signing: canonical recipe text, Ed25519 signatures, rotation statements."""

import pytest

from crowdtrain.core import signing


def recipe(**changes) -> dict:
    doc = signing.recipe_document(
        7,
        "mnist",
        {"name": "cnn1d", "framework": "pytorch", "input_shape": [40], "num_classes": 10, "options": {"w": 0.5}},
        {"lr": 0.001, "batch_size": 32, "optimizer": "adam"},
        {"send": "weights", "dtype": "float32"},
        3,
        ["a" * 64, "b" * 64],
        "c" * 64,
    )
    return doc | changes


def test_canonical_json_is_one_text_whatever_the_key_order() -> None:
    doc = recipe()
    shuffled = dict(reversed(list(doc.items())))
    assert signing.canonical_json(doc) == signing.canonical_json(shuffled)
    assert " " not in signing.canonical_json({"a": [1, 2], "b": {"c": 1.5}})
    with pytest.raises(ValueError):
        signing.canonical_json({"lr": float("nan")})


def test_a_signed_recipe_verifies_with_its_key_only() -> None:
    key, other = signing.generate_private_key(), signing.generate_private_key()
    text = signing.canonical_json(recipe()).encode()
    signature = signing.sign(key, text)
    assert signing.verify(signing.public_key_text(key), text, signature)
    assert not signing.verify(signing.public_key_text(other), text, signature), "another key"
    changed = signing.canonical_json(recipe(training={"lr": 0.1, "batch_size": 32, "optimizer": "adam"})).encode()
    assert not signing.verify(signing.public_key_text(key), changed, signature), "a changed recipe"


@pytest.mark.parametrize("signature", ["", "not base64!", "AAAA", "A" * 86 + "=="])
def test_malformed_signatures_and_keys_do_not_verify(signature: str) -> None:
    key = signing.generate_private_key()
    assert not signing.verify(signing.public_key_text(key), b"x", signature)
    assert not signing.verify("short", b"x", signing.sign(key, b"x"))


def test_keys_round_trip_through_their_files_text() -> None:
    key = signing.generate_private_key()
    again = signing.load_private_key(signing.private_key_pem(key))
    assert signing.public_key_text(again) == signing.public_key_text(key)
    assert signing.check_public_key(signing.public_key_text(key) + "\n") == signing.public_key_text(key)
    assert len(signing.public_key_text(key)) == signing.PUBLIC_KEY_CHARS
    assert len(signing.sign(key, b"x")) == signing.SIGNATURE_CHARS
    with pytest.raises(signing.NotAKey):
        signing.load_private_key(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    with pytest.raises(signing.NotAKey):
        signing.check_public_key("AAAA")
    assert len(signing.key_id(signing.public_key_text(key))) == 16


def test_a_rotation_statement_verifies_only_with_the_old_key() -> None:
    old, new, other = (signing.generate_private_key() for _ in range(3))
    old_pub, new_pub = signing.public_key_text(old), signing.public_key_text(new)
    statement = signing.sign_rotation(old, new_pub)
    assert signing.verify_rotation(old_pub, new_pub, statement)
    assert not signing.verify_rotation(signing.public_key_text(other), new_pub, statement)
    assert not signing.verify_rotation(old_pub, signing.public_key_text(other), statement), "another new key"
    forged = signing.sign_rotation(other, new_pub)
    assert not signing.verify_rotation(old_pub, new_pub, forged), "signed by a key that is not the old one"
    # A recipe's signature is not a statement's: the texts differ.
    assert not signing.verify_rotation(old_pub, new_pub, signing.sign(old, new_pub.encode()))


def test_rotations_are_followed_from_the_trusted_key_to_the_signing_key() -> None:
    a, b, c, x = (signing.generate_private_key() for _ in range(4))
    pa, pb, pc, px = (signing.public_key_text(k) for k in (a, b, c, x))
    chain = [(pa, pb, signing.sign_rotation(a, pb)), (pb, pc, signing.sign_rotation(b, pc))]
    assert signing.follow_rotations(pa, pc, chain) == [pa, pb, pc]
    assert signing.follow_rotations(pb, pc, chain) == [pb, pc]
    assert signing.follow_rotations(pa, pa, []) == [pa]
    assert signing.follow_rotations(pc, pa, chain) is None, "rotations are not followed backwards"
    assert signing.follow_rotations(pa, px, chain) is None
    forged = [(pa, px, signing.sign_rotation(x, px))]
    assert signing.follow_rotations(pa, px, forged) is None, "a statement not signed by the trusted key"
