"""`make test` runs both of its passes (the tests run side by side, then the `serial` ones alone),
whatever the first one's outcome, says how each ended, and fails if either failed. Run for real
on a tiny test folder (PYTEST_ARGS), with the installed project standing in for the virtualenv."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PASSING = "def test_passes():\n    pass\n"
FAILING = "def test_fails():\n    assert False, 'deliberately'\n"
SERIAL_PASSING = "import pytest\n\n\n@pytest.mark.serial\ndef test_serial_passes():\n    pass\n"
SERIAL_FAILING = "import pytest\n\n\n@pytest.mark.serial\ndef test_serial_fails():\n    assert False\n"
# The serial test leaves a mark, so that the test sees that the serial pass ran.
SERIAL_MARKING = (
    "import pathlib\n\nimport pytest\n\n\n@pytest.mark.serial\ndef test_serial_marks():\n"
    "    (pathlib.Path(__file__).parent / 'serial-ran').touch()\n"
)


def make_test(folder: Path, tmp_path: Path, **files: str) -> subprocess.CompletedProcess[str]:
    folder.mkdir()
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    serial: runs alone\n")
    for name, text in files.items():
        (folder / f"test_{name}.py").write_text(text)
    stamp = tmp_path / "installed"  # newer than pyproject.toml: make installs nothing
    stamp.touch()
    make = shutil.which("make")
    assert make, "make is not installed"
    return subprocess.run(
        [make, "-s", "-C", str(ROOT), "test", f"PY={sys.executable}", f"STAMP={stamp}", "TEST_WORKERS=0"]
        + [f"PYTEST_ARGS={folder}"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failure_in_the_parallel_pass_still_runs_the_serial_pass_and_fails_make(tmp_path: Path) -> None:
    folder = tmp_path / "suite"
    done = make_test(folder, tmp_path, fails=FAILING, marks=SERIAL_MARKING)
    assert (folder / "serial-ran").exists(), done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode != 0
    summary = done.stdout.strip().splitlines()[-2:]
    assert summary == ["make test: parallel pass failed (pytest exit 1)", "make test: serial pass passed"], summary


@pytest.mark.parametrize(
    ("files", "returncode", "summary"),
    [
        (
            {"passes": PASSING, "serial": SERIAL_FAILING},
            2,
            ["parallel pass passed", "serial pass failed (pytest exit 1)"],
        ),
        ({"passes": PASSING}, 0, ["parallel pass passed", "serial pass ran no test (pytest exit 5, accepted)"]),
        ({"serial": SERIAL_PASSING}, 2, ["parallel pass failed (pytest exit 5)", "serial pass passed"]),
    ],
    ids=["serial-fails", "no-serial-test", "no-parallel-test"],
)
def test_make_test_reports_both_passes_and_fails_if_either_failed(
    tmp_path: Path, files: dict[str, str], returncode: int, summary: list[str]
) -> None:
    done = make_test(tmp_path / "suite", tmp_path, **files)
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == [f"make test: {line}" for line in summary]
