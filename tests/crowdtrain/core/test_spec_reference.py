"""The job spec's reference page: rendered from the spec's JSON schema, every field in its section, and the
committed page (docs/reference/job-spec.md) the one the schema renders today."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from crowdtrain.core import spec_reference
from crowdtrain.core.jobspec import JobSpec
from crowdtrain.core.modelspec import ZOO_OPTIONS

ROOT = Path(__file__).resolve().parents[3]


def sections(page: str) -> dict[str, list[str]]:
    """The page's sections by heading: the table rows of each, one field name a row."""
    out: dict[str, list[str]] = {}
    for part in page.split("\n## ")[1:]:
        heading, _, body = part.partition("\n")
        rows = [line for line in body.splitlines() if line.startswith("| `")]
        out[heading] = [row.split("`", 2)[1] for row in rows]
    return out


def test_the_committed_page_is_the_one_the_schema_renders() -> None:
    committed = (ROOT / spec_reference.PAGE).read_text()
    assert committed == spec_reference.render(), (
        f"{spec_reference.PAGE} is stale: the job spec's schema changed. Refresh it with `{spec_reference.COMMAND}` "
        f"(python -m crowdtrain.core.spec_reference {spec_reference.PAGE}) and commit it."
    )


def test_every_field_of_every_section_has_a_row() -> None:
    found = sections(spec_reference.render())
    assert found["Top level"] == list(JobSpec.model_fields)
    spec = JobSpec.model_json_schema()
    unchanged = json.dumps(spec)
    titles, defs = spec_reference.sections(spec)
    assert json.dumps(spec) == unchanged, "sections() changed the schema it read"
    for name, title in titles.items():
        assert found[title] == list(defs[name]["properties"]), title
    for model, options in ZOO_OPTIONS.items():
        assert found[f"model.options ({model})"] == list(options.model_fields)
    assert {"assimilation.upload", "scheduling", "validation", "dedloc"} <= found.keys()


class Inner(BaseModel):
    """An inner section."""

    depth: int = Field(3, ge=1, lt=10, description="How deep | with a pipe and a*b")


class Outer(BaseModel):
    name: str = Field(..., min_length=1)
    mode: Literal["a", "b"] = "a"
    inner: Inner = Field(default_factory=Inner)
    limit: float | None = Field(None, gt=0, description="Bounded,\n  over two lines")
    pair: tuple[float, float] = (0.5, 0.9)


def test_a_row_says_type_bounds_default_and_description() -> None:
    page = spec_reference.render(Outer)
    rows = {row.split("`", 2)[1]: row for row in page.splitlines() if row.startswith("| `")}
    assert rows["name"] == "| `name` | string (length ≥ 1) | *required* |  |"
    assert rows["mode"] == '| `mode` | `"a"` \\| `"b"` | `"a"` |  |'
    assert rows["inner"] == "| `inner` | [inner](#inner) | its section's defaults |  |"
    assert rows["limit"] == "| `limit` | number (> 0) or null | `null` | Bounded, over two lines |"
    assert rows["pair"] == "| `pair` | [number, number] | `[0.5, 0.9]` |  |"
    assert rows["depth"] == "| `depth` | integer (≥ 1, < 10) | `3` | How deep \\| with a pipe and a\\*b |"
    assert "## inner\n\nAn inner section.\n" in page


@pytest.mark.parametrize(
    ("title", "anchor"),
    [
        ("assimilation.upload", "assimilationupload"),
        ("model.options (mlp)", "modeloptions-mlp"),
        ("Top level", "top-level"),
    ],
)
def test_anchors_are_the_ones_mkdocs_gives_the_headings(title: str, anchor: str) -> None:
    assert spec_reference.anchor(title) == anchor


def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "crowdtrain.core.spec_reference", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_command_writes_the_page(tmp_path: Path) -> None:
    done = run_module("job-spec.md", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "job-spec.md").read_text() == spec_reference.render()


@pytest.mark.parametrize(
    ("args", "message"),
    [((), "usage: python -m crowdtrain.core.spec_reference"), (("no-such-folder/job-spec.md",), "cannot write it")],
)
def test_bad_arguments_get_a_message_and_exit_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    done = run_module(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
