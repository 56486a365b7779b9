"""`crowdtrain demo` finds its example spec from any working directory, and each mode keeps its output
in a folder of its own."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from crowdtrain.cli import app
from crowdtrain.cli import demo as demo_module
from crowdtrain.core.jobspec import load_job_spec


@pytest.mark.parametrize(
    ("mode", "spec", "runner"),
    [("vc-asgd", "mnist1d-cnn.yaml", "run_demo"), ("dedloc", "mnist1d-dedloc.yaml", "run_dedloc_demo")],
)
def test_the_demo_runs_from_any_directory_with_its_own_output_folder(
    mode: str, spec: str, runner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple] = []
    monkeypatch.setattr(demo_module, runner, lambda *args: ran.append(args) or 0)
    monkeypatch.chdir(tmp_path)

    out = CliRunner().invoke(app, ["demo", "--mode", mode])

    assert out.exit_code == 0, out.output
    [(var_dir, spec_path, *_)] = ran
    assert var_dir == Path("var/demo") / mode
    assert spec_path.is_absolute() and spec_path.name == spec
    assert load_job_spec(spec_path).mode == mode
