"""Is the machine idle? No keyboard/mouse input and little CPU use by anything but the client.

`is_idle` is the pure rule over a window of samples. `IdleMonitor` samples once a second with
psutil and tells the client when idleness changes. Input activity is pluggable (`InputActivity`):
on Linux it is the newest access/modify time of /dev/input/event* and of the logged-in users'
terminals; where none of those can be read the client judges by CPU load alone, and says so.
"""

import glob
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

InputActivity = Callable[[], float | None]
"""Wall-clock time of the latest user input, or None when no source can be read."""


@dataclass(frozen=True)
class IdlePolicy:
    minutes: float
    cpu_percent: float  # CPU use by others, as % of all cores, at or above which the machine is busy

    @property
    def window(self) -> float:
        return self.minutes * 60.0


@dataclass(frozen=True)
class Sample:
    at: float  # wall-clock seconds
    others_cpu_percent: float
    last_input: float | None


def is_idle(samples: Iterable[Sample], now: float, policy: IdlePolicy) -> bool:
    """Idle when, for the whole window before `now`, nobody typed or moved the mouse and every
    CPU sample of other processes stayed under the threshold.

    A window not yet covered by samples is not idle: the client must have watched for the full
    window before it starts, so a busy machine is never mistaken for an idle one at start-up.
    One busy sample ends idleness at once; only a full quiet window restores it.
    """
    since = now - policy.window
    samples = list(samples)
    if not samples or samples[0].at > since:
        return False
    recent = [s for s in samples if s.at >= since]
    if any(s.others_cpu_percent >= policy.cpu_percent for s in recent):
        return False
    inputs = [s.last_input for s in samples if s.last_input is not None]
    return not inputs or max(inputs) < since


def linux_input_activity(device_glob: str = "/dev/input/event*") -> float | None:
    """Newest atime/mtime of the input devices and the users' terminals, None if none is readable."""
    paths = glob.glob(device_glob) + [f"/dev/{u.terminal}" for u in _users() if u.terminal]
    times = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        times.append(max(st.st_atime, st.st_mtime))
    return max(times) if times else None


def _users() -> list:
    try:
        return psutil.users()
    except (OSError, RuntimeError):
        return []


class ProcessTreeCPU:
    """CPU use by everything except one process and its children, as % of all cores."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.known: dict[int, psutil.Process] = {}
        self.cores = psutil.cpu_count() or 1
        psutil.cpu_percent(interval=None)  # the first call only starts the interval

    def others_percent(self) -> float:
        system = psutil.cpu_percent(interval=None)
        return max(0.0, system - self._tree_percent() / self.cores)

    def _tree_percent(self) -> float:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return 0.0
        total = 0.0
        for p in procs:
            # psutil measures a process's CPU between two calls on the same object, so keep them.
            tracked = self.known.setdefault(p.pid, p)
            try:
                total += tracked.cpu_percent(interval=None)
            except psutil.Error:
                self.known.pop(p.pid, None)
        alive = {p.pid for p in procs}
        self.known = {pid: p for pid, p in self.known.items() if pid in alive}
        return total


class IdleMonitor:
    """Samples every `period` seconds and calls `on_change(idle)` whenever idleness flips."""

    def __init__(
        self,
        policy: IdlePolicy,
        on_change: Callable[[bool], None],
        pid: int | None = None,
        input_activity: InputActivity = linux_input_activity,
        period: float = 1.0,
    ):
        self.policy = policy
        self.on_change = on_change
        self.cpu = ProcessTreeCPU(pid or os.getpid())
        self.input_activity = input_activity
        self.period = period
        self.samples: deque[Sample] = deque()
        self.idle = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="idle-monitor", daemon=True)
        self._warned_no_input = False

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()

    def _loop(self) -> None:
        while not self.stop.wait(self.period):
            self.observe(self._sample())

    def _sample(self) -> Sample:
        last_input = self.input_activity()
        if last_input is None and not self._warned_no_input:
            log.info("no input-activity source is readable: idleness is judged by CPU load alone")
            self._warned_no_input = True
        return Sample(time.time(), self.cpu.others_percent(), last_input)

    def explain(self) -> str:
        """Why the machine does not count as idle now, in the volunteer's words."""
        window = self.samples and [s for s in self.samples if s.at >= self.samples[-1].at - self.policy.window]
        if not window:
            return f"watching for {self.policy.minutes:g} idle minutes"
        busiest = max(s.others_cpu_percent for s in window)
        if busiest >= self.policy.cpu_percent:
            return f"other processes used {busiest:.0f}% CPU (limit {self.policy.cpu_percent:g}%)"
        last_input = max((s.last_input for s in window if s.last_input is not None), default=None)
        if last_input is not None and last_input >= window[-1].at - self.policy.window:
            return f"keyboard or mouse used {window[-1].at - last_input:.0f}s ago"
        return f"watching for {self.policy.minutes:g} idle minutes"

    def observe(self, sample: Sample) -> None:
        self.samples.append(sample)
        # Keep one sample older than the window: it shows the window is fully covered.
        while len(self.samples) > 1 and self.samples[1].at <= sample.at - self.policy.window:
            self.samples.popleft()
        idle = is_idle(self.samples, sample.at, self.policy)
        if idle != self.idle:
            self.idle = idle
            log.info(
                "machine is %s (CPU use by other processes %.0f%%)",
                "idle: working" if idle else "in use: pausing",
                sample.others_cpu_percent,
            )
            self.on_change(idle)
