"""The volunteer client as a per-user service: a systemd user unit on Linux, a launchd agent on macOS.

`install` writes the service's file (and the join token, when it was given as a value, into a 0600
file beside the preferences, so that it never appears on a command line), then asks the user's
service manager to start it now and at every login; `uninstall` stops it and removes what `install`
wrote. Both are idempotent in effect: installing over an installed service needs `force`, and
uninstalling nothing says so. The renderers are pure; the service manager is asked through its own
command (`systemctl --user`, `launchctl`), and when it cannot be reached the files stay written and
the outcome carries the exact command that would have been run.
"""

import os
import plistlib
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from crowdtrain.client.preferences import PreferencesError, load_preferences, template

UNIT_NAME = "crowdtrain-client.service"
LAUNCHD_LABEL = "org.crowdtrain.client"
TOKEN_FILE_NAME = "service-join-token"
RESTART_SECONDS = 30  # a scheduler that is down is retried this often, not in a tight loop
MANAGER_TIMEOUT = 60.0


class Platform(StrEnum):
    linux = "linux"
    macos = "macos"


class ServiceError(Exception):
    """A request that cannot be carried out: `str(exc)` says what is wrong and what to do."""


def this_platform() -> Platform | None:
    if sys.platform.startswith("linux"):
        return Platform.linux
    return Platform.macos if sys.platform == "darwin" else None


@dataclass(frozen=True)
class ServicePaths:
    """Where the service's files live for one user: the unit (or plist), the join token file that
    install writes, and launchd's log folder."""

    service: Path
    token: Path
    logs: Path

    @classmethod
    def for_user(cls, platform: Platform, home: Path, xdg_config_home: str | None) -> "ServicePaths":
        # The XDG base directory spec: an unset, empty or relative XDG_CONFIG_HOME means ~/.config.
        config = Path(xdg_config_home) if xdg_config_home and Path(xdg_config_home).is_absolute() else home / ".config"
        if platform is Platform.linux:
            service = config / "systemd" / "user" / UNIT_NAME
        else:
            service = home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        return cls(service, config / "crowdtrain" / TOKEN_FILE_NAME, home / "Library" / "Logs" / "crowdtrain")


def client_argv(python: Path, server: str, join_token_file: Path, preferences: Path, cache: Path) -> list[str]:
    """The command the service runs: this installation's `crowdtrain client`, every path absolute."""
    return [
        str(python),
        "-m",
        "crowdtrain",
        "client",
        "--server",
        server,
        "--join-token-file",
        str(join_token_file),
        "--config",
        str(preferences),
        "--cache",
        str(cache),
    ]


_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def systemd_quote(word: str) -> str:
    """One word of a unit's ExecStart: `%` (specifiers) and `$` (variables) escaped, and words with
    other characters double-quoted with C-style escapes (systemd.service(5), "Command lines")."""
    escaped = word.replace("%", "%%").replace("$", "$$")
    if _PLAIN_WORD.fullmatch(word):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_systemd_unit(argv: Sequence[str]) -> str:
    """A systemd user unit that runs `argv` at a low CPU and I/O priority, restarts it after a
    failure, and starts it when the user's manager starts (login, or boot with lingering)."""
    return "\n".join(
        [
            "[Unit]",
            "Description=crowdtrain volunteer client",
            "Documentation=man:systemd.service(5)",
            "",
            "[Service]",
            "Type=exec",
            "ExecStart=" + " ".join(systemd_quote(w) for w in argv),
            "Environment=PYTHONUNBUFFERED=1",
            # The client abandons its running work on SIGTERM and exits 0; a crash or an unreachable
            # scheduler at start is retried.
            "Restart=on-failure",
            f"RestartSec={RESTART_SECONDS}",
            # A volunteer's machine is theirs first: the client gets the CPU and disk that are left over.
            "Nice=19",
            "IOSchedulingClass=idle",
            "",
            "[Install]",
            "WantedBy=default.target",
            "",
        ]
    )


def render_launchd_plist(argv: Sequence[str], logs: Path) -> bytes:
    """A launchd agent that runs `argv` at login, restarts it when it exits with a failure, and
    logs into `logs`."""
    agent = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": list(argv),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_SECONDS,
        "ProcessType": "Background",
        "LowPriorityIO": True,
        "Nice": 19,
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
        "StandardOutPath": str(logs / "client.log"),
        "StandardErrorPath": str(logs / "client.err.log"),
    }
    return plistlib.dumps(agent, fmt=plistlib.FMT_XML, sort_keys=True)


def activate_commands(platform: Platform, paths: ServicePaths, replacing: bool) -> list[list[str]]:
    """What asks the user's service manager to start the service now and at every login."""
    if platform is Platform.linux:
        commands = [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", UNIT_NAME]]
        return commands + ([["systemctl", "--user", "restart", UNIT_NAME]] if replacing else [])
    return [["launchctl", "bootstrap", f"gui/{os.getuid()}", str(paths.service)]]


def deactivate_commands(platform: Platform) -> list[list[str]]:
    """What stops the service and keeps it from starting at login."""
    if platform is Platform.linux:
        return [["systemctl", "--user", "disable", "--now", UNIT_NAME]]
    return [["launchctl", "bootout", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"]]


def as_shell(commands: list[list[str]]) -> str:
    return " && ".join(shlex.join(c) for c in commands)


def run_manager(commands: list[list[str]]) -> str | None:
    """Run each command in turn; None if all succeeded, else why the first that failed did."""
    for command in commands:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=MANAGER_TIMEOUT)
        except FileNotFoundError:
            return f"`{command[0]}` is not installed here"
        except subprocess.TimeoutExpired:
            return f"`{shlex.join(command)}` did not answer in {MANAGER_TIMEOUT:.0f}s"
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[0]
            return f"`{shlex.join(command)}` failed: {said}"
    return None


@dataclass
class Outcome:
    """What install or uninstall did: the files written or removed, and whether the service
    manager did its part (`manager_error` says why not; `manual` is the command to run instead)."""

    files: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    manager_error: str | None = None
    manual: str = ""


@dataclass(frozen=True)
class Installation:
    """One install request, its paths resolved (`~` expanded, relative paths made absolute)."""

    platform: Platform
    paths: ServicePaths
    python: Path
    server: str
    preferences: Path
    preferences_given: bool
    cache: Path


def install(
    request: Installation, join_token: str | None, join_token_file: Path | None, *, force: bool, enable: bool
) -> Outcome:
    """Write the service (and the token file, for a token given as a value) and, with `enable`,
    start it. Exactly one of `join_token` and `join_token_file` is given."""
    paths = request.paths
    if paths.service.exists() and not force:
        raise ServiceError(f"a service is already installed at {paths.service}; add --force to replace it")
    preferences = _check_preferences(request)
    outcome = Outcome()
    if request.platform is Platform.macos and paths.service.exists() and enable:
        run_manager(deactivate_commands(request.platform))  # bootstrap refuses a loaded agent
    replacing = paths.service.exists()
    if join_token is not None:
        _write_private(paths.token, join_token.strip() + "\n")
        token_file = paths.token
        outcome.files.append(token_file)
    else:
        assert join_token_file is not None
        token_file = join_token_file.expanduser().absolute()
        if paths.token.exists() and token_file != paths.token:
            paths.token.unlink()  # the token an earlier install wrote, which this one no longer names
    if not preferences.exists():
        preferences.parent.mkdir(parents=True, exist_ok=True)
        preferences.write_text(template())
        outcome.files.append(preferences)
    argv = client_argv(request.python, request.server, token_file, preferences, request.cache)
    paths.service.parent.mkdir(parents=True, exist_ok=True)
    if request.platform is Platform.linux:
        paths.service.write_text(render_systemd_unit(argv))
    else:
        paths.logs.mkdir(parents=True, exist_ok=True)
        paths.service.write_bytes(render_launchd_plist(argv, paths.logs))
    outcome.files.insert(0, paths.service)
    commands = activate_commands(request.platform, paths, replacing)
    outcome.manual = as_shell(commands)
    if enable:
        outcome.manager_error = run_manager(commands)
    return outcome


def uninstall(platform: Platform, paths: ServicePaths, preferences: Path) -> Outcome:
    """Stop the service and remove the files install wrote: the unit (or plist), the token file, the
    preferences file if it is still the untouched template, launchd's log folder if it is empty.
    Nothing installed: an empty outcome."""
    outcome = Outcome()
    if paths.service.exists():
        outcome.manager_error = run_manager(deactivate_commands(platform))
        outcome.manual = as_shell(deactivate_commands(platform))
        paths.service.unlink()
        outcome.files.append(paths.service)
        if platform is Platform.linux and outcome.manager_error is None:
            run_manager([["systemctl", "--user", "daemon-reload"]])
    if paths.token.exists():
        paths.token.unlink()
        outcome.files.append(paths.token)
    preferences = preferences.expanduser().absolute()
    if outcome.files and preferences.is_file():
        if preferences.read_text(errors="replace") == template():
            preferences.unlink()
            outcome.files.append(preferences)
        else:
            outcome.kept.append(preferences)
    if platform is Platform.macos and outcome.files and paths.logs.is_dir():
        if any(paths.logs.iterdir()):
            outcome.kept.append(paths.logs)  # the service's logs, the volunteer's to read or delete
        else:
            paths.logs.rmdir()
            outcome.files.append(paths.logs)
    return outcome


def _check_preferences(request: Installation) -> Path:
    """The preferences file the service will read, checked now rather than at the service's start."""
    path = request.preferences
    if not path.exists():
        if request.preferences_given:
            raise ServiceError(f"preferences file {path} does not exist (leave out --config to start from a template)")
        return path
    try:
        load_preferences(path, {})
    except PreferencesError as exc:
        raise ServiceError(str(exc)) from None
    return path


def _write_private(path: Path, text: str) -> None:
    """Write `text` readable by its owner alone (0600), whatever mode an older file had."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)
