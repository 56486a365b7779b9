"""Signed work on the client: the project key it trusts, and the check of each assignment against its
job's signed recipe (crowdtrain.core.signing).

The client pins the project's public key when it joins: the key the volunteer gave (`--project-key`),
else the one the scheduler names at registration, else the first that signs work it is sent (trust
on first use). From then on an assignment is run only if its recipe is signed by the pinned key, or
by a later key that rotation statements signed by the pinned key lead to (the pin then moves on),
and only if what it asks to train is what the recipe says. A client that has pinned no key runs
unsigned work, as every client did before signed work.
"""

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from crowdtrain.client.identity import Identities
from crowdtrain.core import signing
from crowdtrain.core.schemas import AssignmentOut, KeyRotation, SignedRecipe
from crowdtrain.core.schemas_dedloc import PeerJoined

log = logging.getLogger(__name__)


class WorkRefused(Exception):
    """The assignment is not the project's signed work; the message says why."""


@dataclass(frozen=True)
class Checked:
    """An assignment that may run, and the key to pin from now on (the same, or one a rotation led to;
    None while the client trusts no key)."""

    pinned: str | None
    rotated: bool = False


def check_assignment(a: AssignmentOut, pinned: str | None, rotations: list[KeyRotation]) -> Checked:
    """Check `a` against its signed recipe with the `pinned` key (None: unsigned work is accepted, and
    the first key that signs work is pinned). WorkRefused says what is wrong. Pure."""
    checked, recipe = _check_signed(a.job_id, a.signed, pinned, rotations)
    if recipe is not None:
        _check_matches(a, recipe)
    return checked


def check_peer_recipe(joined: PeerJoined, pinned: str | None, rotations: list[KeyRotation]) -> Checked:
    """Check what a DeDLOC peer was given on joining against the job's signed recipe, by the rules of
    `check_assignment`: the model, the dedloc settings and max_steps, the seed and the shards (the state
    of step 0 is checked when it is loaded: `initial_state_sha256`). WorkRefused says what is wrong. Pure."""
    checked, recipe = _check_signed(joined.job_id, joined.signed, pinned, rotations)
    if recipe is None:
        return checked
    given = joined.recipe
    shards = recipe.get("shards")
    differences = [
        name
        for name, ok in (
            ("job_id", recipe.get("job_id") == joined.job_id),
            ("mode", recipe.get("mode") == "dedloc"),
            ("model", recipe.get("model") == given.get("model")),
            (
                "training",
                recipe.get("training")
                == signing.dedloc_training(given.get("dedloc") or {}, int(given.get("max_steps") or 0)),
            ),
            ("seed", type(recipe.get("seed")) is int and recipe.get("seed") == given.get("seed")),
            ("shards", isinstance(shards, list) and all(s.sha256 in shards for s in joined.shards)),
        )
        if not ok
    ]
    if differences:
        raise WorkRefused(
            f"job {joined.job_id} as the scheduler gave it differs from its signed recipe in: {', '.join(differences)}"
        )
    return checked


def initial_state_sha256(joined: PeerJoined) -> str | None:
    """The sha256 of W_s v0 (a DeDLOC job's state of step 0) in the signed recipe `joined` was checked
    against; None for unsigned work."""
    if joined.signed is None:
        return None
    value = json.loads(joined.signed.recipe).get("initial_snapshot")
    return value if isinstance(value, str) else None


def _check_signed(
    job_id: int, signed: SignedRecipe | None, pinned: str | None, rotations: list[KeyRotation]
) -> tuple[Checked, dict | None]:
    """The key that signed `signed` (pinned, or reached from it by rotation statements) and its recipe
    document; (Checked(None), None) for unsigned work while no key is pinned. WorkRefused otherwise."""
    if signed is None:
        if pinned is None:
            return Checked(None), None
        raise WorkRefused(
            f"job {job_id}'s recipe is unsigned; this client runs only work signed by the project key "
            f"{signing.key_id(pinned)}"
        )
    trusted = pinned or signed.public_key
    rotated = False
    if signed.public_key != trusted:
        steps = [(r.old_public_key, r.new_public_key, r.signature) for r in rotations]
        if signing.follow_rotations(trusted, signed.public_key, steps) is None:
            raise WorkRefused(
                f"job {job_id}'s recipe is signed by the key {signing.key_id(signed.public_key)}, not by the "
                f"project key {signing.key_id(trusted)} this client trusts, and no rotation statement signed "
                "by that key leads to it"
            )
        rotated = True
    if not signing.verify(signed.public_key, signed.recipe.encode(), signed.signature):
        raise WorkRefused(
            f"job {job_id}'s recipe signature does not verify with the key {signing.key_id(signed.public_key)}"
        )
    try:
        recipe = json.loads(signed.recipe)
    except ValueError:
        raise WorkRefused(f"job {job_id}'s signed recipe is not JSON") from None
    if not isinstance(recipe, dict) or recipe.get("format") != signing.RECIPE_FORMAT:
        raise WorkRefused(f"job {job_id}'s signed recipe is not a {signing.RECIPE_FORMAT} document")
    return Checked(signed.public_key, rotated), recipe


def _check_matches(a: AssignmentOut, recipe: dict) -> None:
    """What the assignment asks to train is what its signed recipe says."""
    shards, seed = recipe.get("shards"), recipe.get("seed")
    differences = [
        name
        for name, ok in (
            ("job_id", recipe.get("job_id") == a.job_id),
            ("model", recipe.get("model") == a.recipe.model),
            ("training", recipe.get("training") == a.recipe.training),
            ("upload", recipe.get("upload") == a.recipe.upload.model_dump(mode="json")),
            ("seed", type(seed) is int and seed + a.assignment_id == a.recipe.seed),
            ("shard", isinstance(shards, list) and a.shard.sha256 in shards),
            ("snapshot", a.base_version != 0 or recipe.get("initial_snapshot") == a.snapshot.sha256),
        )
        if not ok
    ]
    if differences:
        raise WorkRefused(
            f"assignment {a.assignment_id} differs from job {a.job_id}'s signed recipe in: {', '.join(differences)}"
        )


class ProjectTrust:
    """The project key a client trusts with one scheduler, and the jobs it has refused there: kept
    with its registration (crowdtrain.client.identity), so that a restarted client keeps both (in
    memory only without `identities`, as a DeDLOC peer run without --cache keeps them)."""

    def __init__(self, identities: Identities | None, server_url: str, given_key: str | None = None):
        self.identities = identities
        self.server_url = server_url
        self.given_key = given_key  # --project-key: pinned when the client joins
        self.pinned: str | None = None
        self._refused: set[int] = set()

    @property
    def refused_jobs(self) -> list[int]:
        return sorted(self._refused)

    def key_to_pin(self, offered: str | None) -> str | None:
        """The key to pin when registering: the one already trusted (registering again after the host
        token was refused), else the volunteer's, else the one the scheduler `offered`."""
        return self.pinned or self.given_key or offered

    def load(self, registration: dict) -> None:
        self.pinned = registration.get("project_public_key")
        self._refused = set(registration.get("refused_jobs", []))
        if self.given_key and self.pinned and self.given_key != self.pinned:
            log.warning(
                "--project-key %s is not the key this client trusts (%s, pinned when it joined or reached by "
                "rotation); the pinned key is kept: remove %s to join again with the given key",
                signing.key_id(self.given_key),
                signing.key_id(self.pinned),
                self.identities.path if self.identities is not None else "the identity file",
            )
        if self.pinned:
            log.info("runs only work signed by the project key %s", signing.key_id(self.pinned))
        else:
            log.info("has no project key: runs unsigned work, and will trust the first key that signs work")

    def check(self, a: AssignmentOut, rotations: list[KeyRotation]) -> str | None:
        """None if `a` may run (the pin moves on if a rotation led to its key); else why not, and its
        job is refused from now on."""
        return self._check(
            a.job_id, f"assignment {a.assignment_id}", lambda: check_assignment(a, self.pinned, rotations)
        )

    def check_peer(self, joined: PeerJoined) -> str | None:
        """The same for what a DeDLOC peer was given on joining its job (`check_peer_recipe`)."""
        return self._check(
            joined.job_id,
            f"peer {joined.peer_id}",
            lambda: check_peer_recipe(joined, self.pinned, joined.key_rotations),
        )

    def refuse(self, job_id: int, what: str, reason: str) -> str:
        """Refuse `job_id` from now on, because of `what` (`reason`); returns the reason."""
        log.warning("%s: refused: %s; no more work of job %s is taken", what, reason, job_id)
        self._refused.add(job_id)
        self._keep(refused_jobs=self.refused_jobs)
        return reason

    def _check(self, job_id: int, what: str, check: Callable[[], Checked]) -> str | None:
        try:
            checked = check()
        except WorkRefused as exc:
            return self.refuse(job_id, what, str(exc))
        if checked.pinned != self.pinned and checked.pinned is not None:
            how = "a rotation statement signed by the key it trusted" if checked.rotated else "trust on first use"
            log.info("now trusts the project key %s (%s)", signing.key_id(checked.pinned), how)
            self.pinned = checked.pinned
            self._keep(project_public_key=checked.pinned)
        return None

    def _keep(self, **fields: object) -> None:
        if self.identities is not None:
            self.identities.update(self.server_url, **fields)
