"""Idleness: the pure rule over samples, and a real client that yields to a real CPU hog."""

import os
import subprocess
import sys
from datetime import timedelta

import psutil
import pytest

from crowdtrain.client.idle import IdleMonitor, IdlePolicy, ProcessTreeCPU, Sample, is_idle, linux_input_activity
from crowdtrain.client.status import ClientState, read_status
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import Cluster, wait_for
from tests.client.test_worker import host_assignments
from tests.conftest import EXAMPLE_SPEC

POLICY = IdlePolicy(minutes=1.0, cpu_percent=25.0)
NOW = 10_000.0


def quiet(start: float, end: float, cpu: float = 5.0, last_input: float | None = None) -> list[Sample]:
    return [Sample(t, cpu, last_input) for t in range(int(start), int(end) + 1, 5)]


def test_a_full_quiet_window_is_idle() -> None:
    assert is_idle(quiet(NOW - 70, NOW), NOW, POLICY)


def test_a_window_not_yet_covered_by_samples_is_not_idle() -> None:
    assert not is_idle(quiet(NOW - 30, NOW), NOW, POLICY)
    assert not is_idle([], NOW, POLICY)


def test_one_busy_sample_in_the_window_is_not_idle_but_an_older_one_is_forgotten() -> None:
    busy_recent = quiet(NOW - 70, NOW)
    busy_recent[-3] = Sample(busy_recent[-3].at, 80.0, None)
    assert not is_idle(busy_recent, NOW, POLICY)
    busy_long_ago = [Sample(NOW - 120, 80.0, None), *quiet(NOW - 70, NOW)]
    assert is_idle(busy_long_ago, NOW, POLICY)


def test_cpu_at_the_threshold_counts_as_busy() -> None:
    assert not is_idle(quiet(NOW - 70, NOW, cpu=25.0), NOW, POLICY)


@pytest.mark.parametrize(("last_input", "idle"), [(NOW - 5, False), (NOW - 61, True), (None, True)])
def test_recent_input_is_not_idle_and_unknown_input_leaves_cpu_to_decide(last_input: float | None, idle: bool) -> None:
    assert is_idle(quiet(NOW - 70, NOW, last_input=last_input), NOW, POLICY) is idle


def test_the_monitor_reports_each_change_once_from_injected_input_readings() -> None:
    changes: list[bool] = []
    monitor = IdleMonitor(IdlePolicy(minutes=10 / 60, cpu_percent=200.0), changes.append, input_activity=lambda: None)
    for t in range(0, 12):
        monitor.observe(Sample(1000.0 + t, 0.0, None))
    monitor.observe(Sample(1012.0, 0.0, 1011.5))  # someone touched the keyboard
    for t in range(13, 30):
        monitor.observe(Sample(1000.0 + t, 0.0, 1011.5))
    assert changes == [True, False, True]


def test_the_monitor_explains_why_the_machine_is_not_idle() -> None:
    monitor = IdleMonitor(IdlePolicy(minutes=10 / 60, cpu_percent=50.0), lambda idle: None, input_activity=lambda: None)
    assert monitor.explain() == "watching for 0.166667 idle minutes"
    monitor.observe(Sample(1000.0, 80.0, None))
    assert monitor.explain() == "other processes used 80% CPU (limit 50%)"
    for t in range(1, 12):
        monitor.observe(Sample(1000.0 + t, 0.0, 1009.0))
    assert monitor.explain() == "keyboard or mouse used 2s ago"


def test_the_clients_own_children_count_as_the_client_not_as_other_processes() -> None:
    """This process sleeps in `wait_for` (well under 1% of a core), its child spins: the tree's share
    is the child's. 5% of a core is what a spinning process still gets when another suite keeps
    the 2 cores busy (about 7% at load 28), and never what this process alone uses."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        tree = ProcessTreeCPU(os.getpid())
        tree._tree_percent()  # psutil measures from this first call on
        wait_for(lambda: tree._tree_percent() > 5.0, 120, "the busy child was not counted in the client's tree")
    finally:
        child.kill()
        child.wait()


def test_input_activity_reads_terminal_and_device_times_or_says_it_cannot(tmp_path) -> None:
    device = tmp_path / "event0"
    device.write_bytes(b"")
    os.utime(device, (1_000_000_000, 1_000_000_500))
    assert linux_input_activity(str(tmp_path / "event*")) >= 1_000_000_500


# -- a real client and a real CPU hog --------------------------------------------------------------

IDLE_MINUTES = 0.05  # a 3-second window
WINDOW = timedelta(minutes=IDLE_MINUTES)


def machine_cpu_percent(seconds: float) -> float:
    """The whole machine's CPU use over `seconds`, as % of all cores."""
    return psutil.cpu_percent(interval=seconds)


def start_hog() -> list[subprocess.Popen]:
    """Busy loops on four times as many processes as cores.

    The client runs in a session of its own, and the kernel's autogroup scheduling shares the CPU
    between sessions, not processes: a training client still gets about half of the machine, so
    the hog shows as ~50% CPU by others while the client trains (~100% while it waits or pauses).
    The test's threshold of 35% sits between that and the few per cent the idle cluster uses."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4 * (os.cpu_count() or 1))]


def kill(hog: list[subprocess.Popen]) -> None:
    for p in hog:
        p.kill()
        p.wait()


def submit_long_job(cluster: Cluster) -> None:
    """Assignments that train far longer than the test and whose deadline outlasts the pauses."""
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.training.local_epochs = 500
    spec.scheduling.deadline_seconds = 900
    cluster.submit(spec.model_dump(mode="json"))


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def status_is(cache, state: ClientState, phase: str | None = None):
    def check() -> bool:
        st = read_status(cache)
        return bool(st and st.state == state and (phase is None or [a.phase for a in st.assignments] == [phase]))

    return check


def cpu_while_status_rewritten(pid: int, cache, times: int) -> tuple[float, float]:
    """(client CPU seconds, wall seconds by the status file's clock) over `times` status rewrites."""
    first = read_status(cache).updated_at
    cpu0 = cpu_seconds(pid)
    seen = [first]

    def rewritten() -> bool:
        st = read_status(cache)
        if st and st.updated_at > seen[-1]:
            seen.append(st.updated_at)
        return len(seen) > times

    wait_for(rewritten, 60, "the status file stopped being rewritten")
    return cpu_seconds(pid) - cpu0, (seen[-1] - first).total_seconds()


@pytest.mark.integration
@pytest.mark.serial  # it needs the machine idle but for its own hog
def test_an_idle_only_client_waits_for_a_cpu_hog_to_end_and_pauses_training_while_one_runs(
    make_cluster, sqlite_url: str
) -> None:
    cluster = make_cluster(sqlite_url)
    submit_long_job(cluster)
    # What the client watches is the whole machine: with other work on it (another suite beside this
    # one) it is never idle, and the client rightly never works. The premise is checked, not assumed.
    busy = machine_cpu_percent(seconds=5)
    if busy >= 35:
        pytest.skip(f"the machine is not idle before the test's own hog ({busy:.0f}% CPU by other work)")
    hog = start_hog()
    try:
        client = cluster.start_client(
            "polite", 1, "--no-prefetch", "--idle-only", "--idle-minutes", str(IDLE_MINUTES), "--idle-cpu-percent", "35"
        )
        cache = cluster.var_dir / "clients" / "polite"
        wait_for(
            lambda: "other processes used" in getattr(read_status(cache), "reason", ""),
            60,
            "the client never measured the hog",
            client,
        )
        busy_since = read_status(cache).updated_at
        wait_for(lambda: read_status(cache).updated_at > busy_since + 3 * WINDOW, 60, "no status", client)
        assert read_status(cache).state == ClientState.not_idle
        assert host_assignments(sqlite_url, "polite") == [], "the client took work while the machine was busy"

        kill(hog)
        wait_for(status_is(cache, ClientState.working, "training"), 90, "no work once the hog ended", client)
        assert [st for _, st, _ in host_assignments(sqlite_url, "polite")] == ["in_progress"]

        hog = start_hog()
        wait_for(status_is(cache, ClientState.not_idle, "training (paused)"), 60, "training was not paused", client)
        # Pausing takes effect between batches: the batch under way when the status says paused ends
        # first (0.3 CPU-s here, 0.8 on a machine twice as slow), so the measure starts one rewrite later.
        cpu_while_status_rewritten(client.proc.pid, cache, 1)
        paused_cpu, paused_wall = cpu_while_status_rewritten(client.proc.pid, cache, 3)
        assert paused_cpu < 0.25 * paused_wall, f"a paused client used {paused_cpu:.2f}s CPU in {paused_wall:.1f}s"

        kill(hog)
        wait_for(status_is(cache, ClientState.working, "training"), 90, "training did not resume", client)
        cpu0 = cpu_seconds(client.proc.pid)
        wait_for(lambda: cpu_seconds(client.proc.pid) - cpu0 > 2.0, 60, "the resumed client does not compute", client)
        assert [st for _, st, _ in host_assignments(sqlite_url, "polite")] == ["in_progress"], "same assignment"
    finally:
        kill(hog)
