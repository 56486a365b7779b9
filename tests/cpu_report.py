"""The CPU each test spends, with the processes it starts, and the tests that spend the most.

A pass of the suite on 2 cores is bound by CPU, not by waiting: its wall time is the CPU its tests
spend over the cores, and a test's duration says more about what ran beside it than about itself
(a test of 27 s alone took 240 s in a parallel pass). So each test's CPU is measured: the user and
system time of the process that runs it and of every process it started and waited for (a
cluster's services, their uvicorn and Celery children, clients), from its setup to the end of its
teardown. A process the test leaves running, or that is not waited for, is not counted.

Each test's figure travels with its teardown report (`cpu_s` in its user properties), so under
xdist the controller adds up every worker's tests, and the pass ends with the total and the
CPU_REPORT_TESTS tests that spent the most (`-p no:tests.cpu_report` leaves it out).
"""

import resource

import pytest

CPU_REPORT_TESTS = 30
CPU_PROPERTY = "cpu_s"
_started = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """User and system CPU of this process and of its children that have been waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_started] = cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if call.when == "teardown" and _started in item.stash:
        report.user_properties.append((CPU_PROPERTY, cpu_seconds() - item.stash[_started]))
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    spent = {  # every teardown report, whichever status it is filed under
        report.nodeid: float(value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "teardown"
        for name, value in getattr(report, "user_properties", ())
        if name == CPU_PROPERTY
    }
    if not spent:
        return
    total = sum(spent.values())
    terminalreporter.write_sep("=", f"CPU of the tests and their processes: {total:.0f} s over {len(spent)} tests")
    for nodeid, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:CPU_REPORT_TESTS]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {nodeid}")
