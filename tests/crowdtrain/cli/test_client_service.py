"""`crowdtrain client install-service` / `uninstall-service` through the installed `crowdtrain` command:
the unit passes `systemd-analyze verify`, a user manager (where one can run) enables and disables it,
and a user's mistake is one or two lines and exit 2. Every run has its own HOME and XDG folders, and
an XDG_RUNTIME_DIR with no bus in it unless the test starts its own user manager there."""

import configparser
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CROWDTRAIN = Path(sys.executable).parent / "crowdtrain"
UNIT = "crowdtrain-client.service"
ENABLE = f"systemctl --user daemon-reload && systemctl --user enable --now {UNIT}"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    run = tmp_path / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("CROWDTRAIN_", "XDG_", "DBUS_"))}
    return {
        **clean,
        "HOME": str(tmp_path / "home"),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        "XDG_RUNTIME_DIR": str(run),
        "COLUMNS": "100",
        **extra,
    }


def crowdtrain(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(CROWDTRAIN), *args], env=env, capture_output=True, text=True, timeout=120)


def _unit(tmp_path: Path) -> Path:
    return tmp_path / "xdg" / "systemd" / "user" / UNIT


def test_the_unit_runs_this_installations_client_and_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    env = _env(tmp_path, CROWDTRAIN_CLIENT_JOIN_TOKEN="s3cret-join-token")
    cache = tmp_path / "a cache with spaces"
    done = crowdtrain(
        "client", "install-service", "--server", "http://127.0.0.1:8000", "--cache", str(cache), "--no-enable", env=env
    )
    assert done.returncode == 0, done.stderr
    assert f"not enabled (--no-enable); enable it with: {ENABLE}" in done.stdout

    unit = _unit(tmp_path)
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: apt-get install systemd"
    verify = subprocess.run([analyze, "verify", "--user", str(unit)], env=env, capture_output=True, text=True)
    assert (verify.returncode, verify.stderr) == (0, ""), verify.stderr

    text = unit.read_text()
    parsed = configparser.ConfigParser(interpolation=None)
    parsed.read_string(text)
    token = tmp_path / "xdg" / "crowdtrain" / "service-join-token"
    preferences = tmp_path / "home" / ".config" / "crowdtrain" / "client.toml"
    assert shlex.split(parsed["Service"]["ExecStart"]) == [
        sys.executable,
        "-m",
        "crowdtrain",
        "client",
        "--server",
        "http://127.0.0.1:8000",
        "--join-token-file",
        str(token),
        "--config",
        str(preferences),
        "--cache",
        str(cache),
    ]
    assert parsed["Service"]["Restart"] == "on-failure" and int(parsed["Service"]["RestartSec"]) > 0
    assert parsed["Install"]["WantedBy"] == "default.target"
    assert "s3cret" not in text
    assert token.read_text() == "s3cret-join-token\n" and token.stat().st_mode & 0o777 == 0o600
    assert preferences.is_file()


def test_without_a_user_manager_the_unit_is_written_and_the_command_to_enable_it_printed(tmp_path: Path) -> None:
    env = _env(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    args = ["client", "install-service", "--server", "http://127.0.0.1:8000", "--join-token-file", str(token_file)]

    done = crowdtrain(*args, env=env)

    assert done.returncode == 4, done.stderr
    assert "the service is written but not enabled: `systemctl --user daemon-reload` failed" in done.stderr
    assert done.stderr.strip().endswith(ENABLE)
    assert _unit(tmp_path).is_file()

    removed = crowdtrain("client", "uninstall-service", env=env)
    assert removed.returncode == 0 and str(_unit(tmp_path)) in removed.stdout, removed.stderr
    assert not _unit(tmp_path).exists() and token_file.exists()
    assert not (tmp_path / "home" / ".config" / "crowdtrain" / "client.toml").exists()
    again = crowdtrain("client", "uninstall-service", env=env)
    assert again.returncode == 0 and again.stdout.startswith("nothing to uninstall: no service at "), again.stderr


def test_the_launchd_agent_is_rendered_on_request_and_not_loaded_without_launchctl(tmp_path: Path) -> None:
    if shutil.which("launchctl"):
        pytest.skip("launchctl is here: this test would load the agent into the user's own session")
    env = _env(tmp_path, CROWDTRAIN_CLIENT_JOIN_TOKEN="s3cret")
    done = crowdtrain("client", "install-service", "--server", "http://127.0.0.1:8000", "--platform", "macos", env=env)
    plist = tmp_path / "home" / "Library" / "LaunchAgents" / "org.crowdtrain.client.plist"
    assert done.returncode == 4, done.stderr
    assert "`launchctl` is not installed here" in done.stderr
    assert done.stderr.strip().endswith(f"launchctl bootstrap gui/{os.getuid()} {plist}")
    removed = crowdtrain("client", "uninstall-service", "--platform", "macos", env=env)
    assert removed.returncode == 0 and not plist.exists(), removed.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], ["needs --server"]),
        (["--server", "127.0.0.1:8000"], ["not an http:// or https:// URL"]),
        (["--server", "http://h", "--join-token-file", "/nonexistent/token"], ["cannot read /nonexistent/token"]),
        (["--server", "http://h"], ["--join-token", "required"]),
        (["--server", "http://h", "--join-token", "t", "--config", "/nonexistent.toml"], ["does not exist"]),
        (["--server", "http://h", "--join-token", "t", "--platform", "linux"], ["already installed", "--force"]),
    ],
    ids=["no-server", "server-not-url", "token-file-unreadable", "no-token", "no-config", "installed"],
)
def test_a_mistake_is_one_or_two_lines_and_exit_2(tmp_path: Path, args: list[str], words: list[str]) -> None:
    env = _env(tmp_path)
    _unit(tmp_path).parent.mkdir(parents=True)
    if "already installed" in words:
        _unit(tmp_path).write_text("[Service]\nExecStart=/bin/true\n")
    done = crowdtrain("client", "install-service", "--no-enable", *args, env=env)
    _assert_explained(done, *words)
    assert not (tmp_path / "xdg" / "crowdtrain" / "service-join-token").exists()


def test_options_of_the_client_before_a_subcommand_are_refused_not_dropped(tmp_path: Path) -> None:
    done = crowdtrain("client", "--server", "http://h", "install-service", "--no-enable", env=_env(tmp_path))
    _assert_explained(done, "--server: give these after the command's name")
    assert not _unit(tmp_path).exists()


def _assert_explained(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 2 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.fixture
def user_manager(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private `systemd --user` whose runtime and configuration folders are the test's; skipped,
    saying why, where none can run (a container whose init is not systemd)."""
    env = _env(tmp_path)
    systemd = shutil.which("systemd") or "/usr/lib/systemd/systemd"
    if not Path(systemd).exists():
        pytest.skip("no systemd user manager: systemd is not installed")
    manager = subprocess.Popen([systemd, "--user"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        state = ""
        for _ in range(100):
            if manager.poll() is not None:
                booted = "" if Path("/run/systemd/system").exists() else " (this system was not booted with systemd)"
                pytest.skip(f"no systemd user manager: `systemd --user` exited with {manager.returncode}{booted}")
            ask = ["systemctl", "--user", "is-system-running"]
            state = subprocess.run(ask, env=env, capture_output=True, text=True, timeout=30).stdout.strip()
            if state in {"running", "degraded"}:
                break
            time.sleep(0.2)
        else:
            pytest.skip(f"no systemd user manager: `systemd --user` did not come up in 20s ({state})")
        yield env
    finally:
        manager.terminate()
        try:
            manager.wait(timeout=30)
        except subprocess.TimeoutExpired:
            manager.kill()
            manager.wait()


def test_a_user_manager_enables_the_service_and_uninstall_disables_it(
    tmp_path: Path, user_manager: dict[str, str]
) -> None:
    env = {**user_manager, "CROWDTRAIN_CLIENT_JOIN_TOKEN": "s3cret"}
    done = crowdtrain("client", "install-service", "--server", "http://127.0.0.1:9", env=env)
    assert done.returncode == 0 and f"started {UNIT}" in done.stdout, done.stderr

    def is_enabled() -> subprocess.CompletedProcess:
        return subprocess.run(["systemctl", "--user", "is-enabled", UNIT], env=env, capture_output=True, text=True)

    assert is_enabled().stdout.strip() == "enabled"
    removed = crowdtrain("client", "uninstall-service", env=env)
    assert removed.returncode == 0 and removed.stderr == "", removed.stderr
    assert is_enabled().returncode != 0 and not _unit(tmp_path).exists()
