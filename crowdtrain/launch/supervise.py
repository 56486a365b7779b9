"""Keep one child process running: restart it when it dies, stop it when we are told to stop.

The parameter server runs Celery under this: a Celery worker can die of an unrecoverable broker
error (kombu loses its connection object when Redis restarts mid-acknowledgement), and a merge
service must come back by itself, in the embedded default as well as under a container's restart
policy. Its unacknowledged tasks are redelivered, and merges are idempotent, so a restart loses
nothing.
"""

import logging
import signal
import subprocess
import threading
import time

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 30.0
STABLE_AFTER_SECONDS = 60.0  # a child that ran this long resets the backoff


def supervise(argv: list[str], name: str) -> int:
    """Run `argv` until we get SIGTERM/SIGINT (passed on to it); returns its last exit code.

    A child that exits by itself is started again whatever its status: a Celery worker that hit an
    unrecoverable broker error has been seen to exit 0, and a merge service must not stay down.
    """
    stopping = threading.Event()
    child: subprocess.Popen | None = None

    def forward(signum, _frame) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    backoff = 1.0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(argv)
        rc = child.wait()
        if stopping.is_set():
            return rc
        backoff = 1.0 if time.monotonic() - started > STABLE_AFTER_SECONDS else min(backoff * 2, MAX_BACKOFF_SECONDS)
        log.warning("%s exited with status %s; starting it again in %.0fs", name, rc, backoff)
        if stopping.wait(backoff):
            return rc
