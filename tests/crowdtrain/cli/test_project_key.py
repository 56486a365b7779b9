"""The project key on the operator's machine: `crowdtrain admin keygen` never overwrites a key and
keeps the private one to its owner; a recipe that is not what the spec says is not signed."""

import json
from pathlib import Path

from typer.testing import CliRunner

from crowdtrain.cli import app
from crowdtrain.cli.projectkey import recipe_differences
from crowdtrain.core import signing
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.updates import upload_of
from tests.conftest import EXAMPLE_SPEC


def test_keygen_writes_a_private_key_for_its_owner_only_and_never_overwrites(tmp_path: Path) -> None:
    made = CliRunner().invoke(app, ["admin", "keygen", "--out", str(tmp_path)])
    assert made.exit_code == 0, made.output
    shown = json.loads(made.output)
    private, public = tmp_path / "project.key", tmp_path / "project.pub"
    assert private.stat().st_mode & 0o777 == 0o600
    key = signing.load_private_key(private.read_bytes())
    assert signing.public_key_text(key) == public.read_text().strip() == shown["public_key"]
    before = private.read_bytes()
    again = CliRunner().invoke(app, ["admin", "keygen", "--out", str(tmp_path)])
    assert again.exit_code == 2 and "never overwritten" in again.output
    assert private.read_bytes() == before


def test_a_recipe_that_differs_from_the_spec_is_named_by_its_fields() -> None:
    spec = load_job_spec(EXAMPLE_SPEC)
    recorded = spec.model_dump(mode="json")

    def recipe(**changes) -> str:
        doc = signing.recipe_document(
            1,
            spec.name,
            spec.configure_model([40], 10),
            recorded["training"],
            upload_of(recorded["assimilation"]).model_dump(mode="json"),
            spec.seed,
            ["a" * 64],
            "b" * 64,
        )
        return signing.canonical_json(doc | changes)

    assert recipe_differences(recipe(), spec) == []
    assert recipe_differences(recipe(training=recorded["training"] | {"lr": 5.0}), spec) == ["training"]
    changed_model = spec.configure_model([40], 10) | {"options": {"channels": 1}}
    assert recipe_differences(recipe(model=changed_model, seed=9), spec) == ["seed", "model"]
    assert recipe_differences("not json", spec) == ["the recipe is not JSON"]
