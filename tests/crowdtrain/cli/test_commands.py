"""The root command loads each command's module only when that command runs, and its help page,
written without them, says what each command's own help says."""

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import click
import pytest
import typer
from typer.testing import CliRunner

from crowdtrain.cli import COMMANDS, app

SERVER_ONLY = ("fastapi", "sqlalchemy", "celery", "redis", "uvicorn", "alembic", "boto3")


@pytest.mark.parametrize("name", COMMANDS)
def test_the_root_help_of_each_command_is_the_first_paragraph_of_its_own(name: str) -> None:
    command = COMMANDS[name].load()
    assert COMMANDS[name].help == command.help.split("\n\n")[0].strip()


def test_the_root_help_lists_every_command_in_order_with_its_help() -> None:
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    shown = {name: lazy for name, lazy in COMMANDS.items() if not lazy.hidden}
    rows = [out.output.index(f"│ {name} ") for name in shown]
    assert rows == sorted(rows)
    assert all(lazy.help in out.output for lazy in shown.values())
    hidden = [name for name, lazy in COMMANDS.items() if lazy.hidden]
    assert hidden == ["assimilator-worker"] and all(f"│ {name} " not in out.output for name in hidden)


def test_the_parameter_server_s_supervisor_imports_no_server_package() -> None:
    """`crowdtrain assimilator` only starts and restarts its worker: the worker alone imports them."""
    probe = (
        "import sys\n"
        "import crowdtrain.cli.assimilator\n"
        f"print(sorted(m for m in {SERVER_ONLY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_a_command_is_the_one_its_module_defines() -> None:
    group = typer.main.get_command(app)
    client = group.get_command(click.Context(group), "client")
    assert client.name == "client" and {"status", "install-service", "uninstall-service"} <= set(client.commands)
    assert "--join-token" in {opt for p in client.params for opt in p.opts}


@pytest.mark.parametrize("args", [["--help"], ["client", "--help"], ["client", "status", "--help"]])
def test_help_and_the_client_import_no_server_package(args: list[str]) -> None:
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from crowdtrain.cli import app\n"
        f"result = CliRunner().invoke(app, {args!r})\n"
        "assert result.exit_code == 0, result.output\n"
        f"print(sorted(m for m in {SERVER_ONLY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("words", "imported"),
    [
        ("crowdtrain ", []),
        ("crowdtrain cl", []),
        ("crowdtrain client --", ["crowdtrain.cli.client", "crowdtrain.cli.client_service", "crowdtrain.cli.options"]),
    ],
)
def test_shell_completion_imports_only_the_command_being_completed(words: str, imported: list[str]) -> None:
    """Tab completion of a command's name offers every command from the registry; completing a
    command's options imports that command's module alone (a client-only install completes too)."""
    probe = (
        "import sys\n"
        "from crowdtrain.cli import app\n"
        "ROOT = {'crowdtrain.cli.lazy', 'crowdtrain.cli.errors'}  # what the root itself imports\n"
        "try:\n"
        "    app(prog_name='crowdtrain')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('crowdtrain.cli.') and m not in ROOT), "
        "file=sys.stderr)\n"
    )
    words_split = words.split(" ")  # as bash's COMP_WORDS: the last word is the one being completed
    env = {
        **os.environ,
        "_CROWDTRAIN_COMPLETE": "complete_bash",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words_split) - 1),
    }
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    offered = done.stdout.split()
    incomplete = words_split[-1]
    if imported:
        assert "--server" in offered
    else:
        assert offered == [name for name, lazy in COMMANDS.items() if name.startswith(incomplete) and not lazy.hidden]
    assert done.stderr.strip().splitlines()[-1] == repr(imported)


def _commands(command: Any, ctx: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """Every command under `command` (its context `ctx`) with the words that run it and its context,
    each lazy command loaded."""
    yield path, command, ctx
    for name in command.list_commands(ctx) if hasattr(command, "list_commands") else []:
        sub = command.get_command(ctx, name)
        yield from _commands(sub, sub.make_context(name, [], parent=ctx, resilient_parsing=True), (*path, name))


def _all_commands() -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    root = typer.main.get_command(app)
    return _commands(root, root.make_context("crowdtrain", [], resilient_parsing=True))


ALL_COMMANDS = [words for words, _, _ in _all_commands() if words]


def test_every_server_option_reads_crowdtrain_server() -> None:
    servers = {
        words: opt.envvar for words, command, _ in _all_commands() for opt in command.params if opt.name == "server"
    }
    assert {("client",), ("peer",), ("job", "list"), ("job", "status"), ("job", "plot"), ("fleet", "up")} <= set(
        servers
    )
    assert set(servers.values()) == {"CROWDTRAIN_SERVER"}


@pytest.mark.parametrize("words", ALL_COMMANDS, ids=" ".join)
def test_help_is_readable_at_80_columns_with_every_default_shown(words: tuple[str, ...]) -> None:
    """Descriptions get at least 30 of the 80 columns, and every option either shows its default, says
    it in its help, is required, or has none to show (show_default=False: a secret, an optional path)."""
    out = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert max(len(line) for line in lines) <= 80, out.output
    options = lines[lines.index("Options:") + 1 :] if "Options:" in lines else []
    for line in options:
        if line.strip() and not line.lstrip().startswith("-"):
            assert len(line) - len(line.lstrip()) <= 50, f"a description column narrower than 30:\n{out.output}"
    [(command, ctx)] = [(c, x) for w, c, x in _all_commands() if w == words]
    for param in command.params:
        if param.param_type_name != "option" or param.required or param.show_default is False or param.hidden:
            continue
        record = param.get_help_record(ctx)
        assert record is not None and "default" in record[1], f"{' '.join(words)} {param.opts}: {record}"


@pytest.mark.parametrize("words", ALL_COMMANDS, ids=" ".join)
def test_every_command_has_help_and_names_its_arguments_on_the_usage_line(words: tuple[str, ...]) -> None:
    """A command says what it does; each argument has an upper-case metavar and a help line, and the usage
    line writes it as that metavar (`JOB_ID`, not `{job_id}`)."""
    [(command, ctx)] = [(c, x) for w, c, x in _all_commands() if w == words]
    assert (command.help or "").strip(), f"crowdtrain {' '.join(words)} has no help text"
    out = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "120"})
    assert out.exit_code == 0, out.output
    usage = out.output.split("\n\n", 1)[0]
    assert "{" not in usage, usage
    for param in command.params:
        if param.param_type_name != "argument":
            continue
        assert param.metavar and param.metavar == param.metavar.upper(), f"{words} {param.name}: {param.metavar}"
        assert (param.help or "").strip(), f"{words} {param.name} has no help"
        assert f" {param.metavar}" in usage, usage
