"""The operator's project key on the operator's machine: key files, and signing a job's recipe with
the private key (crowdtrain.core.signing) so that only the public key ever reaches the scheduler."""

import json
import os
from pathlib import Path
from typing import Annotated

import httpx
import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from crowdtrain.cli.adminapi import checked
from crowdtrain.core import signing
from crowdtrain.core.jobspec import JobSpec
from crowdtrain.core.schemas_jobs import JobRecipe
from crowdtrain.core.updates import upload_of

PRIVATE_KEY_FILE = "project.key"
PUBLIC_KEY_FILE = "project.pub"
KEY_ENV = "CROWDTRAIN_PROJECT_KEY_FILE"
KeyOpt = Annotated[
    Path | None,
    typer.Option(
        "--key",
        envvar=KEY_ENV,
        show_envvar=True,
        show_default=False,
        help=f"The project's private key ({PRIVATE_KEY_FILE} from `crowdtrain admin keygen`) that signs the recipe",
    ),
]


def write_key_pair(folder: Path) -> tuple[Path, Path, str]:
    """A new key pair in `folder`: project.key (PEM, readable by its owner only) and project.pub (the
    public key's base64). FileExistsError, writing nothing, if either file exists. Returns both
    paths and the public key."""
    folder.mkdir(parents=True, exist_ok=True)
    private, public = folder / PRIVATE_KEY_FILE, folder / PUBLIC_KEY_FILE
    for path in (private, public):
        if path.exists():
            raise FileExistsError(f"{path} exists: a project key is never overwritten (choose another --out)")
    key = signing.generate_private_key()
    with os.fdopen(os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(signing.private_key_pem(key))
    public_key = signing.public_key_text(key)
    public.write_text(public_key + "\n")
    return private, public, public_key


def read_private_key(path: Path) -> Ed25519PrivateKey:
    """The private key in `path`; exit 2 saying why if it cannot be read."""
    try:
        return signing.load_private_key(path.expanduser().read_bytes()[:100_000])
    except (OSError, signing.NotAKey) as exc:
        typer.echo(f"error: {path}: {exc}", err=True)
        raise typer.Exit(2) from None


def read_public_key(path: Path) -> str:
    """The public key in `path` (project.pub); exit 2 saying why if it is not one."""
    try:
        return signing.check_public_key(path.expanduser().read_text(errors="replace")[:1000])
    except (OSError, signing.NotAKey) as exc:
        typer.echo(f"error: {path}: {exc}", err=True)
        raise typer.Exit(2) from None


def recipe_differences(recipe: str, spec: JobSpec) -> list[str]:
    """The fields of the scheduler's `recipe` that are not what the operator's `spec` says: the model
    (name, framework, options, Keras JSON), the training settings, the upload encoding, the seed and
    the name. The shards' and W_s v0's hashes are made on the scheduler and cannot be checked here."""
    try:
        document = json.loads(recipe)
    except ValueError:
        return ["the recipe is not JSON"]
    if not isinstance(document, dict):
        return ["the recipe is not an object"]
    found = document.get("model")
    model: dict = found if isinstance(found, dict) else {}
    recorded = spec.model_dump(mode="json")
    expected = spec.configure_model([], 0)
    checks = {
        "format": document.get("format") == signing.RECIPE_FORMAT,
        "name": document.get("name") == spec.name,
        "seed": document.get("seed") == spec.seed,
        "model": all(model.get(k) == v for k, v in expected.items() if k not in ("input_shape", "num_classes")),
        "mode": document.get("mode", "vc-asgd") == spec.mode,
        "training": document.get("training") == signing.recipe_training(recorded),
        "upload": document.get("upload") == upload_of(recorded.get("assimilation", {})).model_dump(mode="json"),
    }
    return [name for name, ok in checks.items() if not ok]


def sign_job(
    http: httpx.Client, job_id: int, key: Ed25519PrivateKey, recipe: str | None = None, spec: JobSpec | None = None
) -> JobRecipe:
    """Sign the job's recipe (fetched unless given) here and send the signature; the scheduler checks it
    with the project key. With the `spec` it was submitted from, a recipe that differs from it is
    not signed. Exit 2 with the reason if the signature is refused or not made."""
    if recipe is None:
        recipe = JobRecipe.model_validate(checked(http.get(f"/v1/jobs/{job_id}/recipe"))).recipe
    differences = recipe_differences(recipe, spec) if spec is not None else []
    if differences:
        typer.echo(
            f"error: job {job_id}'s recipe differs from the spec in {', '.join(differences)}: not signed", err=True
        )
        raise typer.Exit(2)
    signature = signing.sign(key, recipe.encode())
    return JobRecipe.model_validate(checked(http.post(f"/v1/jobs/{job_id}/signature", json={"signature": signature})))
