"""Signed work: the operator's Ed25519 project key signs each job's recipe, and clients check it.

What is signed is a recipe's canonical JSON text (`canonical_json`): the job's id, name and mode, the
model configuration (a Keras model's JSON included), the training settings (a DeDLOC job's: its
`dedloc` section and max_steps), the upload encoding, the seed, the sha256 of every shard of the
submission's deal and of W_s version 0 (a DeDLOC job's state at step 0). The scheduler
keeps that text and sends it, with its signature, beside every assignment; a client verifies the
bytes it received, never a re-encoding of them.

A key is rotated by a statement: the new public key signed by the old private key. A client that
trusts the old key follows such statements to the new one, and trusts only the new one after.

Public keys travel as the base64 of their 32 raw bytes, signatures as the base64 of their 64;
private keys are PKCS#8 PEM. No I/O: keys come in and go out as text or bytes.
"""

import base64
import binascii
import hashlib
import json
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

RECIPE_FORMAT = "crowdtrain-recipe/1"
ROTATION_FORMAT = "crowdtrain-key-rotation/1"
PUBLIC_KEY_CHARS = 44  # base64 of 32 bytes
SIGNATURE_CHARS = 88  # base64 of 64 bytes


class NotAKey(ValueError):
    """Text that is not a key or a signature of the expected kind."""


def canonical_json(document: Any) -> str:
    """One text per document: keys sorted, no spaces, no NaN; what a signature covers."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def recipe_document(
    job_id: int,
    name: str,
    model: dict[str, Any],
    training: dict[str, Any],
    upload: dict[str, Any],
    seed: int,
    shards: list[str],
    initial_snapshot: str,
    mode: str = "vc-asgd",
) -> dict[str, Any]:
    """The recipe of a job as it is signed: what a client trains with, and the hashes of what it trains on.

    `shards` are the sha256 of the submission's shards in index order, `initial_snapshot` the sha256
    of W_s version 0. A client checks an assignment against it: the same model, training settings and
    upload, seed + assignment id as the seed, a shard among `shards`, and W_s v0 if it starts from v0.
    A DeDLOC peer (`mode` "dedloc") checks the model, `training` (what `dedloc_training` makes), the
    seed, the shards and the state of step 0 against it."""
    return {
        "format": RECIPE_FORMAT,
        "job_id": job_id,
        "name": name,
        "mode": mode,
        "model": model,
        "training": training,
        "upload": upload,
        "seed": seed,
        "shards": shards,
        "initial_snapshot": initial_snapshot,
    }


def dedloc_training(dedloc: dict[str, Any], max_steps: int) -> dict[str, Any]:
    """The training settings of a DeDLOC job's recipe: its `dedloc` section (JSON) and its max_steps."""
    return {"dedloc": dedloc, "max_steps": max_steps}


def recipe_training(spec: dict[str, Any]) -> dict[str, Any]:
    """The training settings a job's recipe signs, from its spec as JSON: what a client trains with, or
    what a DeDLOC peer runs."""
    if spec.get("mode") == "dedloc":
        return dedloc_training(spec["dedloc"], spec["stop"]["max_steps"])
    training: dict[str, Any] = spec["training"]
    return training


def _b64decode(text: str, size: int, what: str) -> bytes:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise NotAKey(f"{what} is not base64") from None
    if len(raw) != size:
        raise NotAKey(f"{what} must be {size} bytes, got {len(raw)}")
    return raw


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    """A PKCS#8 PEM private key (as `private_key_pem` writes it); NotAKey if it is not an Ed25519 one."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise NotAKey(f"not a PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise NotAKey(f"not an Ed25519 private key (a {type(key).__name__})")
    return key


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public half of `key` as base64 of its 32 raw bytes."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def check_public_key(text: str) -> str:
    """`text` as a public key, stripped; NotAKey if it is not base64 of 32 bytes of a valid key."""
    raw = _b64decode(text, 32, "a public key")
    try:
        Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise NotAKey("not an Ed25519 public key") from None
    return base64.b64encode(raw).decode()


def key_id(public_key: str) -> str:
    """A short name of a public key for messages and logs: the first 16 hex digits of its sha256."""
    return hashlib.sha256(public_key.strip().encode()).hexdigest()[:16]


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    return base64.b64encode(key.sign(message)).decode()


def verify(public_key: str, message: bytes, signature: str) -> bool:
    """Whether `signature` is `public_key`'s over `message`; False for any malformed key or signature."""
    try:
        public = Ed25519PublicKey.from_public_bytes(_b64decode(public_key, 32, "a public key"))
        public.verify(_b64decode(signature, 64, "a signature"), message)
    except (NotAKey, ValueError, InvalidSignature):
        return False
    return True


def rotation_message(old_public_key: str, new_public_key: str) -> bytes:
    """The bytes of a rotation statement: the old key hands trust to the new one."""
    return canonical_json({"format": ROTATION_FORMAT, "old": old_public_key, "new": new_public_key}).encode()


def sign_rotation(old: Ed25519PrivateKey, new_public_key: str) -> str:
    """The old private key's signature of the statement that `new_public_key` follows it."""
    return sign(old, rotation_message(public_key_text(old), new_public_key))


def verify_rotation(old_public_key: str, new_public_key: str, signature: str) -> bool:
    return old_public_key != new_public_key and verify(
        old_public_key, rotation_message(old_public_key, new_public_key), signature
    )


def follow_rotations(trusted: str, target: str, rotations: list[tuple[str, str, str]]) -> list[str] | None:
    """The keys from `trusted` to `target` through verified statements (old, new, signature), `trusted`
    first and `target` last; None if no such path. Statements that do not verify are ignored."""
    chain, seen = [trusted], {trusted}
    while chain[-1] != target:
        step = next(
            (
                new
                for old, new, signature in rotations
                if old == chain[-1] and new not in seen and verify_rotation(old, new, signature)
            ),
            None,
        )
        if step is None:
            return None
        chain.append(step)
        seen.add(step)
    return chain
