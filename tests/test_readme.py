"""The manual's commands work as written. The quick start's (docs/quick-start.md) "Running the parts
yourself" is followed: its first `sh` block is run line by line, the way a newcomer with one terminal
per long-running process follows it. Every `crowdtrain` command line of README.md and of the manual's
pages names real commands and options.

The block is cut into statements (a heredoc is one statement, and so are lines joined by a trailing
backslash). A statement whose comment says
`terminal N` is a long-running process: it is started in the background, in its own process group
with its output in a log file. The scheduler must answer `/v1/health/live` before the next statement;
the other terminals start side by side and must be ready (a line in their log says so) before the
next statement that runs to completion. Every such statement runs with `bash -c` after the files
sourced so far (`. .venv/bin/activate`, `. var/crowdtrain.env`), as in one shell session, and must
exit 0; a terminal that exits meanwhile fails the test. A statement whose comment says `when done`
runs after the terminals are stopped (Ctrl-C, clients first), as a newcomer stops them first.

The only substitutions are those a second copy on a shared machine needs: Redis's port 6379 and
the scheduler's port 8000 become free ports. The block runs in a fresh directory that holds links to
the repository's `examples/` and to the virtual environment running the tests as `.venv` (which the
block activates: it is taken off PATH, so `python` and `crowdtrain` resolve only through the README),
with no `CROWDTRAIN_*` variables inherited and a fresh HOME (no user's client preferences apply).
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NoReturn

import click
import pytest
import redis
import typer.main

from crowdtrain.cli import app
from crowdtrain.launch.cluster import Service, free_port, scheduler_is_live, start_redis, wait_for

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICK_START = ROOT / "docs" / "quick-start.md"
SECTION = "## Running the parts yourself"
TERMINAL = re.compile(r"#.*\bterminal (\d+)\b")
WHEN_DONE = re.compile(r"#.*\bwhen done\b")
SOURCE = re.compile(r"(\.|source)\s+\S+")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
STATEMENT_TIMEOUT = 120.0
WATCH_TIMEOUT = 600.0  # `job watch` runs until the job ends
SETTLE_SECONDS = 2.0


def section_block(text: str, heading: str) -> str:
    """The first ```sh block after `heading`, before the next heading of the same level."""
    after = text.split(heading, 1)[1]
    section = re.split(r"^## ", after, flags=re.M)[0]
    found = re.search(r"^```sh\n(.*?)^```", section, flags=re.M | re.S)
    assert found, f"no ```sh block under {heading!r} in {QUICK_START.relative_to(ROOT)}"
    return found[1]


def statements(block: str) -> list[str]:
    """Shell statements of `block`, one a line except a heredoc, which runs to its delimiter line, and lines
    joined by a trailing backslash."""
    lines = block.replace("\\\n", " ").splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if heredoc := HEREDOC.search(line):
            end = lines.index(heredoc[2], i)
            out.append("\n".join(lines[i - 1 : end + 1]))
            i = end + 1
        else:
            out.append(line)
    return out


def with_free_ports(block: str, redis_port: int, server_port: int) -> str:
    return re.sub(r"\b8000\b", str(server_port), re.sub(r"\b6379\b", str(redis_port), block))


# What says that a terminal's process is ready, in its log; the scheduler is ready when it answers /v1/health/live.
READY_LINE = {
    "crowdtrain assimilator": re.compile(r"\bready\.$", re.M),
    "crowdtrain transitioner": re.compile(r"transitioner running"),
    "crowdtrain client": re.compile(r"registered with"),
}
READY_TIMEOUT = 120.0


@dataclass
class Newcomer:
    """One shell session's worth of state: the directory, the environment, the files sourced so far, and
    the terminals opened."""

    cwd: Path
    env: dict[str, str]
    server_url: str
    sourced: str = ""
    terminals: list[Service] = field(default_factory=list)
    starting: list[tuple[Service, str]] = field(default_factory=list)
    stopped: bool = False

    def run(self, statement: str, number: int) -> str:
        """Run `statement` to completion after the files sourced so far; its output, or the test fails."""
        self.await_terminals()
        timeout = WATCH_TIMEOUT if " job watch " in f" {statement} " else STATEMENT_TIMEOUT
        log = self.cwd / "logs" / f"statement-{number}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", self.sourced + statement],
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        why = ""
        while proc.poll() is None and not why:
            if time.monotonic() > deadline:
                why = f"still running after {timeout:.0f}s"
            elif not self.stopped and (dead := [t.name for t in self.terminals if not t.alive]):
                why = f"{', '.join(dead)} exited meanwhile"
            time.sleep(0.25)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        output = log.read_text(errors="replace")
        if why or proc.returncode != 0:
            self.fail(statement, why or f"exit status {proc.returncode}", output)
        if SOURCE.fullmatch(statement.split("#", 1)[0].strip()):
            self.sourced += statement + "\n"
        return output

    def start(self, statement: str, terminal: str) -> None:
        """Open terminal `terminal` and start `statement` in it. The scheduler must answer before the next
        statement; the others start side by side and must be ready before the next statement that runs
        to completion."""
        name = f"terminal-{terminal}"
        # A terminal opened in the newcomer's directory, the files sourced so far, then the command.
        script = f"cd {shlex.quote(str(self.cwd))}\n{self.sourced}exec {statement}"
        service = Service(name, ["bash", "-c", script], self.env, self.cwd / "logs" / f"{name}.log").start()
        self.terminals.append(service)
        self.starting.append((service, statement))
        if "crowdtrain server" in statement:
            self.await_terminals()

    def await_terminals(self) -> None:
        for service, statement in self.starting:
            line = next((ready for command, ready in READY_LINE.items() if command in statement), None)
            if "crowdtrain server" in statement:
                ready = partial(scheduler_is_live, self.server_url)
            elif line is not None:
                ready = partial(lambda line, service: bool(line.search(service.tail(1000))), line, service)
            else:
                time.sleep(SETTLE_SECONDS)
                ready = partial(lambda service: service.alive, service)
            try:
                wait_for(ready, READY_TIMEOUT, f"{service.name} was not ready", service)
            except (RuntimeError, TimeoutError) as exc:
                self.fail(statement, str(exc).splitlines()[0], "")
        self.starting.clear()

    def stop_terminals(self) -> None:
        """Ctrl-C in each terminal, the last opened (the clients) first, while the scheduler can still take
        back their work; whatever does not end within 20 s is killed."""
        self.stopped = True
        for terminal in reversed(self.terminals):
            terminal.signal(signal.SIGINT)
            if terminal.proc is None:
                continue
            try:
                terminal.proc.wait(20)
            except subprocess.TimeoutExpired:
                terminal.signal(signal.SIGKILL)
                terminal.proc.wait(5)

    def fail(self, statement: str, why: str, output: str) -> NoReturn:
        terminals = "\n".join(f"--- {t.name}: {t.argv[-1].splitlines()[-1]}\n{t.tail(40)}" for t in self.terminals)
        pytest.fail(
            f"quick start statement failed ({why}):\n{statement}\n--- its output:\n{output[-4000:]}\n{terminals}"
        )


def newcomer_env(home: Path) -> dict[str, str]:
    """The test's environment as a fresh shell's: no crowdtrain settings, no virtual environment active."""
    venv_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROWDTRAIN_") and k != "VIRTUAL_ENV"}
    path = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry and entry != venv_bin]
    return env | {"PATH": os.pathsep.join(path), "HOME": str(home), "PYTHONUNBUFFERED": "1"}


@pytest.mark.integration
def test_running_the_parts_yourself_works_as_written(tmp_path: Path) -> None:
    redis_port, server_port = free_port(), free_port()
    block = with_free_ports(section_block(QUICK_START.read_text(), SECTION), redis_port, server_port)
    work = tmp_path / "newcomer"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    venv = Path(sys.prefix)
    assert (venv / "bin" / "activate").is_file(), f"the tests do not run in a virtual environment: {venv}"
    (work / ".venv").symlink_to(venv)
    (tmp_path / "home").mkdir()
    you = Newcomer(work, newcomer_env(tmp_path / "home"), f"http://127.0.0.1:{server_port}")
    (work / "logs").mkdir()
    outputs: dict[str, str] = {}
    when_done: list[tuple[int, str]] = []
    try:
        for number, statement in enumerate(statements(block), 1):
            if terminal := TERMINAL.search(statement):
                you.start(statement, terminal[1])
            elif WHEN_DONE.search(statement):
                when_done.append((number, statement))
            else:
                outputs[statement.split("#", 1)[0].strip()] = you.run(statement, number)
        you.stop_terminals()
        for number, statement in when_done:
            you.run(statement, number)
    finally:
        you.stop_terminals()
        # `redis-server --daemonize yes` leaves its process group: shut it down if the block did not.
        subprocess.run(
            ["redis-cli", "-p", str(redis_port), "shutdown", "nosave"], capture_output=True, env=you.env, timeout=30
        )

    status = next(output for command, output in outputs.items() if command.startswith("crowdtrain job status 1"))
    assert "succeeded" in status, status
    assert (work / "accuracy.png").read_bytes().startswith(b"\x89PNG")
    assert (work / "model.safetensors").stat().st_size > 0


def redis_session(tmp_path: Path, redis_port: int) -> tuple[Path, dict[str, str], list[str], list[str]]:
    """The quick start's block up to its first terminal, and its `when done` statements, each as one shell
    script, for a newcomer in a fresh directory whose Redis port is `redis_port`."""
    block = with_free_ports(section_block(QUICK_START.read_text(), SECTION), redis_port, free_port())
    work = tmp_path / "newcomer"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "home").mkdir()
    every = statements(block)
    first_terminal = next(i for i, statement in enumerate(every) if TERMINAL.search(statement))
    setup = [statement for statement in every[:first_terminal] if not statement.startswith("crowdtrain ")]
    sourced = [statement for statement in setup if SOURCE.fullmatch(statement.split("#", 1)[0].strip())]
    done = [statement for statement in every if WHEN_DONE.search(statement)]
    return work, newcomer_env(tmp_path / "home"), setup, [*sourced, *done]


def shell(script: list[str], work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )


def test_the_quick_starts_redis_listens_on_loopback_and_stops_by_its_pidfile(tmp_path: Path) -> None:
    """The Redis the quick start starts listens on 127.0.0.1 only, writes its pidfile under var/ (an absolute
    path: redis-server resolves a relative one against its --dir), and `when done` stops it."""
    port = free_port()
    work, env, setup, when_done = redis_session(tmp_path, port)
    pidfile = work / "var" / "redis.pid"
    try:
        started = shell(setup, work, env)
        assert started.returncode == 0, started.stdout + started.stderr
        wait_for(pidfile.exists, 15, f"no pidfile at {pidfile}")
        pid = int(pidfile.read_text())
        client = redis.Redis(port=port)
        assert client.info("server")["process_id"] == pid
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        client.close()
        stopped = shell(when_done, work, env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 15, f"the quick start's Redis (pid {pid}) still runs")
    finally:
        # Daemonized, it left the test's process group: shut down whatever still answers on its private port.
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=30)


def test_the_quick_start_leaves_a_redis_already_on_its_port_alone(tmp_path: Path) -> None:
    """With a Redis already on the port (the system's, say), the quick start says so and what to do, starts
    none, and its `when done` line does not stop that Redis."""
    port = free_port()
    system_redis = start_redis(tmp_path / "system-redis", port)
    try:
        work, env, setup, when_done = redis_session(tmp_path, port)
        started = shell(setup, work, env)
        assert started.returncode != 0
        assert f"a Redis already answers on port {port}: stop it, or use a free port" in started.stderr
        assert not (work / "var" / "redis.pid").exists()
        shell(when_done, work, env)
        time.sleep(1)
        assert system_redis.alive and redis.Redis(port=port).ping()
    finally:
        system_redis.stop()


def manual_pages() -> list[Path]:
    """README.md and every page of the manual."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def command_lines(text: str) -> list[str]:
    """Every `crowdtrain` command line of a Markdown page: in its `sh` blocks (continuation lines joined) and
    in its inline code, comments cut off."""
    lines = [
        line
        for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.M | re.S)
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("crowdtrain ")
    ]
    return [line.split("#", 1)[0].strip() for line in lines + re.findall(r"`(crowdtrain [^`]*)`", text)]


# Commands the manual documents that another line of work is adding: their lines are checked once the
# command exists, and skipped until then.
ANNOUNCED = {("client", "install-service"), ("client", "uninstall-service")}


def check_command_line(page: str, line: str) -> None:
    """`line` names commands that exist (`a|b`: each of them) and options of the command it names
    (`[--opt X]` included), as the real command line declares them."""
    words = [w for w in line.replace("[", " ").replace("]", " ").split()[1:] if w != "..."]
    command = typer.main.get_command(app)
    named: list[str] = []
    while words and hasattr(command, "get_command"):
        context = click.Context(command)
        found = [command.get_command(context, name) for name in words[0].split("|")]
        if found[0] is None:
            if (*named, words[0]) in ANNOUNCED:
                return
            break
        assert all(found), f"{page}: {line!r}: no command {words[0]!r}"
        named.append(words[0])
        command, words = found[0], words[1:]
    if hasattr(command, "get_command") and words and not words[0].startswith("-"):
        pytest.fail(f"{page}: {line!r}: {command.name} has no command {words[0]!r}")
    options = {"--help"} | {o for p in command.params for o in [*p.opts, *p.secondary_opts]}
    unknown = [w for w in words if w.startswith("-") and w.split("=", 1)[0] not in options]
    assert not unknown, f"{page}: {line!r}: {command.name} has no option {unknown}"


@pytest.mark.parametrize("page", manual_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_manual_names_real_commands_and_options(page: Path) -> None:
    """Each `crowdtrain` command line of README.md and of each page of the manual names commands that exist
    and options of the command it names."""
    for line in command_lines(page.read_text()):
        check_command_line(str(page.relative_to(ROOT)), line)


def test_the_command_check_sees_the_manuals_commands() -> None:
    """The check above reads the command lines where they are: the quick start's block and the volunteer
    guide's client commands, and it refuses a command or an option that does not exist."""
    lines = [line for page in manual_pages() for line in command_lines(page.read_text())]
    assert "crowdtrain job submit examples/mnist1d-cnn.yaml" in lines
    assert any(line.startswith("crowdtrain client install-service ") for line in lines)
    with pytest.raises(AssertionError, match="no option"):
        check_command_line("page", "crowdtrain job submit --no-such-option")
    with pytest.raises(pytest.fail.Exception, match="no command"):
        check_command_line("page", "crowdtrain job resubmit 1")
