"""Idleness: the pure rule over samples, and a real client that yields to a real CPU hog."""

import os
import signal
import subprocess
import sys

import pytest

from client.idle import IdleMonitor, IdlePolicy, Sample, is_idle, linux_input_activity

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
def test_recent_input_is_not_idle_and_unknown_input_leaves_cpu_to_decide(last_input: float | None,
                                                                          idle: bool) -> None:
    assert is_idle(quiet(NOW - 70, NOW, last_input=last_input), NOW, POLICY) is idle


def test_the_monitor_reports_each_change_once_from_injected_input_readings() -> None:
    changes: list[bool] = []
    monitor = IdleMonitor(IdlePolicy(minutes=10 / 60, cpu_percent=200.0), changes.append,
                          input_activity=lambda: None)
    for t in range(0, 12):
        monitor.observe(Sample(1000.0 + t, 0.0, None))
    monitor.observe(Sample(1012.0, 0.0, 1011.5))  # someone touched the keyboard
    for t in range(13, 30):
        monitor.observe(Sample(1000.0 + t, 0.0, 1011.5))
    assert changes == [True, False, True]


def test_input_activity_reads_terminal_and_device_times_or_says_it_cannot(tmp_path) -> None:
    device = tmp_path / "event0"
    device.write_bytes(b"")
    os.utime(device, (1_000_000_000, 1_000_000_500))
    assert linux_input_activity(str(tmp_path / "event*")) >= 1_000_000_500
