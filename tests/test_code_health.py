"""The code passes its linters: ruff (ruff.toml: lint rules and the format) over the repository, and
mypy (mypy.ini) over the installed layout, where every module has its `crowdtrain.` name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from crowdtrain.core.settings import user_cache_dir

ROOT = Path(__file__).resolve().parents[1]
RUFF = {"lint": ["check", "--no-cache", "."], "format": ["format", "--check", "--no-cache", "."]}


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _output(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n{done.stdout[-8000:]}{done.stderr[-4000:]}"


@pytest.mark.parametrize("command", RUFF.values(), ids=list(RUFF))
def test_ruff_passes(command: list[str]) -> None:
    done = _run([sys.executable, "-m", "ruff", *command], ROOT)
    assert done.returncode == 0, _output(done)


def test_mypy_passes_on_the_installed_layout(installed_tree: Path) -> None:
    """mypy.ini from the repository, run on the wheel's tree. Its cache is kept outside the checkout, in
    the user's cache folder (crowdtrain.core.settings.user_cache_dir), so that a fresh clone on a machine
    that checked the code before does not check torch's and the other libraries' stubs again (21 CPU-s
    with no cache, 1.5 with one). mypy checks each cached module's hash: a change is always checked."""
    env = {**os.environ, "MYPYPATH": str(installed_tree)}
    config, cache = ROOT / "mypy.ini", user_cache_dir() / "mypy"
    done = _run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(cache), "-p", "crowdtrain"],
        installed_tree,
        env,
    )
    assert done.returncode == 0, _output(done)
