"""The client's service files: a systemd unit's command line survives systemd's quoting, the launchd
agent parses back with plistlib (and plutil where it exists), and uninstall removes what install wrote."""

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crowdtrain.client import service
from crowdtrain.client.preferences import load_preferences, template
from crowdtrain.client.service import Installation, Platform, ServiceError, ServicePaths


@pytest.mark.parametrize(
    ("word", "quoted"),
    [
        ("/usr/bin/python3", "/usr/bin/python3"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("/home/a b/cache", '"/home/a b/cache"'),
        ("/tmp/100%", "/tmp/100%%"),
        ("/tmp/$HOME", '"/tmp/$$HOME"'),
        ('say "hi"\\', '"say \\"hi\\"\\\\"'),
    ],
)
def test_a_word_of_the_command_line_is_quoted_for_systemd(word: str, quoted: str) -> None:
    assert service.systemd_quote(word) == quoted


def test_the_preferences_template_sets_nothing_and_names_every_preference() -> None:
    path_text = template()
    assert all(line == "" or line.startswith("#") for line in path_text.splitlines())
    for name in ("tasks", "idle_only", "cache_max_bytes", "account", "download_origins"):
        assert f"# {name} =" in path_text


def _request(tmp_path: Path, platform: Platform) -> Installation:
    home = tmp_path / "home"
    return Installation(
        platform=platform,
        paths=ServicePaths.for_user(platform, home, str(tmp_path / "xdg")),
        python=Path(sys.executable).absolute(),
        server="https://crowdtrain.example.org",
        preferences=home / ".config" / "crowdtrain" / "client.toml",
        preferences_given=False,
        cache=home / ".cache" / "crowdtrain",
    )


def test_the_launchd_agent_runs_the_client_at_login_and_restarts_it_after_a_failure(tmp_path: Path) -> None:
    request = _request(tmp_path, Platform.macos)
    outcome = service.install(request, "s3cret", None, force=False, enable=False)
    plist = tmp_path / "home" / "Library" / "LaunchAgents" / "org.crowdtrain.client.plist"
    assert outcome.files[0] == plist
    with plist.open("rb") as f:
        agent = plistlib.load(f)
    logs = tmp_path / "home" / "Library" / "Logs" / "crowdtrain"
    token = tmp_path / "xdg" / "crowdtrain" / "service-join-token"
    assert agent["Label"] == "org.crowdtrain.client"
    assert agent["ProgramArguments"] == [
        sys.executable,
        "-m",
        "crowdtrain",
        "client",
        "--server",
        "https://crowdtrain.example.org",
        "--join-token-file",
        str(token),
        "--config",
        str(request.preferences),
        "--cache",
        str(request.cache),
    ]
    assert agent["RunAtLoad"] is True and agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["StandardOutPath"] == str(logs / "client.log") and logs.is_dir()
    assert agent["ProcessType"] == "Background" and agent["LowPriorityIO"] is True
    assert b"s3cret" not in plist.read_bytes() and token.read_text() == "s3cret\n"
    assert token.stat().st_mode & 0o777 == 0o600
    assert outcome.manual == f"launchctl bootstrap gui/{os.getuid()} {plist}"
    if shutil.which("plutil"):
        lint = subprocess.run(["plutil", "-lint", str(plist)], capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("platform", list(Platform))
@pytest.mark.parametrize("edited", [False, True])
def test_uninstall_removes_what_install_wrote_and_then_finds_nothing(
    tmp_path: Path, platform: Platform, edited: bool
) -> None:
    request = _request(tmp_path, platform)
    written = service.install(request, "s3cret", None, force=False, enable=False).files
    assert set(written) == {request.paths.service, request.paths.token, request.preferences}
    assert load_preferences(request.preferences, {}) == load_preferences(None, {})  # the template sets nothing
    if edited:  # by the volunteer, and the agent has logged
        request.preferences.write_text(template() + "tasks = 2\n")
        if platform is Platform.macos:
            (request.paths.logs / "client.log").write_text("a line the agent wrote\n")

    outcome = service.uninstall(platform, request.paths, request.preferences)

    assert not request.paths.service.exists() and not request.paths.token.exists()
    assert request.preferences.exists() is edited
    assert request.paths.logs.exists() is (edited and platform is Platform.macos)
    assert outcome.kept == ([request.preferences] + [request.paths.logs] * (platform is Platform.macos)) * edited
    assert service.uninstall(platform, request.paths, request.preferences).files == []


def test_a_token_file_given_is_named_by_the_service_and_not_copied(tmp_path: Path) -> None:
    request = _request(tmp_path, Platform.linux)
    given = tmp_path / "token"
    given.write_text("s3cret\n")
    service.install(request, None, given, force=False, enable=False)
    unit = request.paths.service.read_text()
    assert f"--join-token-file {given} " in unit and "s3cret" not in unit
    assert not request.paths.token.exists()


def test_an_installed_service_is_replaced_only_when_forced(tmp_path: Path) -> None:
    request = _request(tmp_path, Platform.linux)
    service.install(request, "first", None, force=False, enable=False)
    with pytest.raises(ServiceError, match="--force"):
        service.install(request, "second", None, force=False, enable=False)
    assert request.paths.token.read_text() == "first\n"
    service.install(request, "second", None, force=True, enable=False)
    assert request.paths.token.read_text() == "second\n"


def test_preferences_that_the_client_would_refuse_are_refused_at_install(tmp_path: Path) -> None:
    request = _request(tmp_path, Platform.linux)
    request.preferences.parent.mkdir(parents=True)
    request.preferences.write_text("tasks = 0\n")
    with pytest.raises(ServiceError, match="tasks"):
        service.install(request, "s3cret", None, force=False, enable=False)
    assert not request.paths.service.exists() and not request.paths.token.exists()
