"""`crowdtrain demo` finds its example spec from any working directory, each mode keeps its output
in a folder of its own, it prints the dashboard's login, and with --keep leaves the server side running."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from crowdtrain.cli import app
from crowdtrain.cli import demo as demo_module
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import scheduler_is_live


@pytest.mark.parametrize(
    ("mode", "spec", "runner"),
    [
        ("vc-asgd", "mnist1d-cnn.yaml", "run_demo"),
        ("dedloc", "mnist1d-dedloc.yaml", "run_dedloc_demo"),
        ("moe", "clusters-moe.yaml", "run_demo"),
    ],
)
def test_the_demo_runs_from_any_directory_with_its_own_output_folder(
    mode: str, spec: str, runner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple] = []
    monkeypatch.setattr(demo_module, runner, lambda *args: ran.append(args) or 0)
    monkeypatch.chdir(tmp_path)

    out = CliRunner().invoke(app, ["demo", "--mode", mode])

    assert out.exit_code == 0, out.output
    [(var_dir, spec_path, *_)] = ran
    assert var_dir == Path("var/demo") / mode
    assert spec_path.is_absolute() and spec_path.name == spec
    assert load_job_spec(spec_path).mode == mode


def _tiny_spec(tmp_path: Path) -> Path:
    """The example job with a target its first evaluation reaches: the demo's whole course, in seconds."""
    spec = yaml.safe_load((demo_module.EXAMPLES / "mnist1d-cnn.yaml").read_text())
    spec["stop"] = {"target_accuracy": 0.01, "max_epochs": 2}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _demo_argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "crowdtrain",
        "demo",
        "--var-dir",
        str(tmp_path / "var"),
        "--spec",
        str(_tiny_spec(tmp_path)),
        "--clients",
        "1",
        "--tasks",
        "1",
        "--parameter-servers",
        "1",
        *extra,
    ]


LOGIN_LINE = re.compile(r"dashboard: (?P<url>http://127\.0\.0\.1:\d+)/dashboard/login\s+admin token: (?P<token>\S+)")


def _dashboard_login(url: str, token: str) -> httpx.Response:
    return httpx.post(f"{url}/dashboard/login", data={"token": token}, follow_redirects=False, timeout=30)


@pytest.mark.integration
def test_the_demo_prints_the_dashboard_login_and_stops_everything_without_keep(tmp_path: Path) -> None:
    done = subprocess.run(_demo_argv(tmp_path), capture_output=True, text=True, timeout=900, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    login = LOGIN_LINE.search(done.stdout)
    assert login is not None, done.stdout
    assert "left running" not in done.stdout
    assert not scheduler_is_live(login["url"]), "the demo stops the scheduler when the job ends"


@pytest.mark.integration
def test_the_demo_with_keep_leaves_the_dashboard_up_until_ctrl_c(tmp_path: Path) -> None:
    """Started as a shell without job control starts a background command, with SIGINT ignored: Ctrl-C
    still stops it (Python raises no KeyboardInterrupt for an ignored SIGINT unless told to)."""
    proc = subprocess.Popen(
        _demo_argv(tmp_path, "--keep"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        preexec_fn=_ignore_sigint,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 900
        while not any("left running" in line for line in seen):
            assert proc.poll() is None or not lines.empty(), "".join(seen)
            assert time.monotonic() < deadline, "".join(seen)
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
        output = "".join(seen)
        assert "crowdtrain demo summary" in output, output
        logins = LOGIN_LINE.findall(output)
        assert len(logins) == 2 and logins[0] == logins[1], output  # once at the start, again when kept
        url, token = logins[0]

        time.sleep(2)  # still up after the job, not only while the demo stops
        assert proc.poll() is None and scheduler_is_live(url)
        assert httpx.get(f"{url}/dashboard/login", timeout=30).status_code == 200
        # The printed token is the dashboard's login: it gets a session cookie, a wrong one does not.
        assert _dashboard_login(url, token).status_code == 303
        assert _dashboard_login(url, token + "x").status_code == 401

        proc.send_signal(signal.SIGINT)
        stopping = time.monotonic()
        assert proc.wait(timeout=120) == 0, "".join(seen)
        print(f"the kept demo stopped {time.monotonic() - stopping:.1f}s after Ctrl-C")
        assert not scheduler_is_live(url), "Ctrl-C stops the kept scheduler"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _env() -> dict[str, str]:
    """Wide output, so that the login line is one line."""
    return dict(os.environ) | {"COLUMNS": "200"}
