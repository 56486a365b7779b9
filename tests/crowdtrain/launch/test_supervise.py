"""The supervisor restarts a child that dies and passes SIGTERM on to it."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crowdtrain.launch.cluster import wait_for

# Exits with status sys.argv[2] on its first two runs, then runs until SIGTERM and exits 0.
CHILD = """
import pathlib, signal, sys, time
runs = pathlib.Path(sys.argv[1])
n = int(runs.read_text() or 0) + 1 if runs.exists() else 1
runs.write_text(str(n))
if n <= 2:
    sys.exit(int(sys.argv[2]))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.1)
"""

SUPERVISOR = """
import sys
from crowdtrain.launch.supervise import supervise
sys.exit(supervise([sys.executable, "-c", *sys.argv[1:]], "child"))
"""


@pytest.mark.parametrize("status", [3, 0], ids=["failed", "exited-0-by-itself"])
def test_a_dying_child_is_started_again_and_sigterm_stops_both(tmp_path: Path, status: int) -> None:
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, CHILD, str(runs), str(status)], stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: runs.exists() and runs.read_text() == "3", 30, "the child was not restarted twice")
        time.sleep(0.5)  # the third run is up and waiting for SIGTERM
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
    assert runs.read_text() == "3", "started again after SIGTERM"
    assert proc.stderr.read().count(f"exited with status {status}; starting it again") == 2
