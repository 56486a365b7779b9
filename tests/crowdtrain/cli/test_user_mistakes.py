"""What a user's mistake prints: one or two lines and a non-zero exit code, never a traceback
(`--debug` shows it). Each case runs the real `crowdtrain` command in a child process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE_SPEC

# Installed into a child through PYTHONPATH: the packages named in CROWDTRAIN_TEST_ABSENT cannot be
# found or imported there, as in an install without their extra.
ABSENT_PACKAGES = """
import importlib.abc, os, sys

class _Absent(importlib.abc.MetaPathFinder):
    names = set(os.environ.get("CROWDTRAIN_TEST_ABSENT", "").split(","))

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None

sys.meta_path.insert(0, _Absent())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def crowdtrain(*args: str, tmp_path: Path, absent: str = "", **env: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(ABSENT_PACKAGES)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CROWDTRAIN_")}
    child_env = {**clean, "PYTHONPATH": str(site), "CROWDTRAIN_TEST_ABSENT": absent, "COLUMNS": "100", **env}
    return subprocess.run(
        [sys.executable, "-m", "crowdtrain", *args],
        env=child_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_explained(done: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 2 and lines[0].startswith("error: "), done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


def test_no_admin_token_is_named_with_the_setting_that_gives_it(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{_free_port()}"
    for args in (("job", "list"), ("admin", "host", "list")):
        assert_explained(crowdtrain(*args, "--server", server, tmp_path=tmp_path), 2, "CROWDTRAIN_ADMIN_TOKEN")


def test_a_scheduler_that_is_not_running_is_named_by_its_address(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{_free_port()}"
    done = crowdtrain("job", "list", "--server", server, tmp_path=tmp_path, CROWDTRAIN_ADMIN_TOKEN="t" * 32)
    assert_explained(done, 3, f"cannot reach the scheduler at {server}", "crowdtrain server")
    debug = crowdtrain("--debug", "job", "list", "--server", server, tmp_path=tmp_path, CROWDTRAIN_ADMIN_TOKEN="t" * 32)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConnectError" in debug.stderr


def test_a_spec_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{_free_port()}"
    token = {"CROWDTRAIN_ADMIN_TOKEN": "t" * 32}
    done = crowdtrain("job", "submit", str(tmp_path / "missing.yaml"), "--server", server, tmp_path=tmp_path, **token)
    assert done.returncode == 2 and "missing.yaml" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "broken.yaml").write_text(Path(EXAMPLE_SPEC).read_text().replace("subsets: 4", "subsets: [4"))
    done = crowdtrain("job", "submit", "broken.yaml", "--server", server, tmp_path=tmp_path, **token)
    assert done.returncode == 2 and "broken.yaml" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["server", "migrate", "demo"])
def test_a_command_of_an_extra_not_installed_is_left_out_of_the_help_and_explained(tmp_path: Path, command) -> None:
    absent = "uvicorn,sqlalchemy,celery,redis"  # a client-only install: no server packages
    listed = crowdtrain("--help", tmp_path=tmp_path, absent=absent)
    assert listed.returncode == 0, listed.stderr
    commands = [line.split()[1] for line in listed.stdout.splitlines() if line.startswith("│ ") and line.split()[1:]]
    assert "client" in commands and "job" in commands and command not in commands
    assert "Not in this install" in listed.stdout and "crowdtrain[server]" in listed.stdout
    assert_explained(
        crowdtrain(command, tmp_path=tmp_path, absent=absent), 2, f"crowdtrain {command}", "crowdtrain[server]"
    )
    full = crowdtrain("--help", tmp_path=tmp_path)
    assert "Not in this install" not in full.stdout and f"│ {command} " in full.stdout
