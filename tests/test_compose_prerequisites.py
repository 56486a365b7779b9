"""`make compose-test` on a machine without what it needs: it names each missing command and the
Debian package that brings it, says how to install them, and exits 1 before it starts anything. The
check runs for real (`compose-test.sh --prerequisites`) on a PATH that holds only the few commands the
check itself uses, with installing forbidden; no Docker engine is started."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "compose" / "compose-test.sh"
# What the check itself runs: nothing of what compose-test needs.
BASICS = ("dirname", "id")


def bare_path(folder: Path, *present: str) -> Path:
    """A PATH folder with the basics, and a stand-in executable for each command of `present`."""
    folder.mkdir()
    for name in BASICS:
        found = shutil.which(name)
        assert found, f"{name} is not installed"
        (folder / name).symlink_to(found)
    for name in present:
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
        (folder / name).chmod(0o755)
    return folder


def prerequisites(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(SCRIPT), "--prerequisites"],
        env={"PATH": str(path), "HOME": os.environ.get("HOME", "/tmp"), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("present", "missing", "packages"),
    [
        ((), "docker dockerd debootstrap curl docker-compose", "docker.io debootstrap curl docker-compose"),
        (("debootstrap", "curl"), "docker dockerd docker-compose", "docker.io docker-compose"),
    ],
    ids=["nothing", "debootstrap and curl"],
)
def test_what_compose_test_lacks_is_named_with_its_install_command(
    tmp_path: Path, present: tuple[str, ...], missing: str, packages: str
) -> None:
    done = prerequisites(bare_path(tmp_path / "bin", *present), COMPOSE_TEST_INSTALL="no")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == f"make compose-test needs commands this machine lacks: {missing}", done.stderr
    assert lines[1] == f"install them as root on Debian or Ubuntu: apt-get install -y {packages}", done.stderr
    assert "COMPOSE_TEST_INSTALL=no" in lines[2]
    assert done.stdout == ""  # nothing installed, nothing started


def test_the_makefile_checks_the_prerequisites_before_making_the_virtualenv() -> None:
    """`make -n compose-test` (commands printed, none run): the check comes before .venv is made."""
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "compose-test", "STAMP=/nonexistent/.installed"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    commands = done.stdout.splitlines()
    check = next(i for i, c in enumerate(commands) if "compose-test.sh --prerequisites" in c)
    install = next(i for i, c in enumerate(commands) if "pip install" in c)
    assert check < install, done.stdout
