"""A command group whose commands are imported by module name only when one of them runs.

A client-only install (`pip install 'crowdtrain[client]'`) lacks the server's packages, so the root
command must not import the server-side command modules: `crowdtrain --help` lists every command
from the help text kept beside its module name, and `crowdtrain client` imports the client's
module alone. This follows Click's "lazily loading subcommands" pattern on Typer's group class.
"""

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import typer
from typer.core import TyperCommand, TyperGroup

from crowdtrain.cli.errors import EXTRA_OF, UserError, missing_extra

if TYPE_CHECKING:
    # Typer vendors Click as its private `typer._click` and exports no names for the types its group
    # methods take and return; the overrides below must accept them, so only their annotations use them.
    from typer._click import Command, Context, HelpFormatter


@dataclass(frozen=True)
class LazyCommand:
    """Where a command lives: the module's `app` (a typer.Typer) is the command, or, with `member`,
    holds it under that name. `help` is the command's first line, shown in the group's help."""

    module: str
    help: str
    member: str | None = None
    needs: tuple[str, ...] = ()  # packages of an extra the command imports (crowdtrain.cli.errors.EXTRA_OF)
    hidden: bool = False  # run by another command, not by hand: left out of the help

    def missing(self) -> str | None:
        """The first package the command needs that this install lacks, or None."""
        return next((package for package in self.needs if not _installed(package)), None)

    def load(self) -> TyperCommand | TyperGroup:
        command = typer.main.get_command(importlib.import_module(self.module).app)
        if self.member is not None:
            if not isinstance(command, TyperGroup):
                raise TypeError(f"{self.module}.app is one command, not a group holding {self.member}")
            command = command.commands[self.member]
        if not isinstance(command, TyperCommand | TyperGroup):
            raise TypeError(f"{self.module}.app does not make a Typer command: {type(command).__name__}")
        return command


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken or half-removed package
        return False


class LazyGroup(TyperGroup):
    """A Typer group that also offers the commands of `lazy_commands`, each imported on first use.

    Until then a command is a placeholder that carries its help, which is all the group's help page
    reads of it."""

    lazy_commands: ClassVar[dict[str, LazyCommand]] = {}

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, lazy in self.lazy_commands.items():
            self.commands.setdefault(name, TyperCommand(name, help=lazy.help, hidden=lazy.hidden))
        self._unloaded = set(self.lazy_commands)
        self._listing = False

    def get_command(self, ctx: "Context", cmd_name: str) -> "Command | None":
        if cmd_name in self._unloaded and not self._listing:
            missing = self.lazy_commands[cmd_name].missing()
            if missing is not None:
                raise UserError(f"crowdtrain {cmd_name}: {missing_extra(missing)}")
            loaded = self.lazy_commands[cmd_name].load()
            loaded.name = cmd_name
            self.commands[cmd_name] = loaded
            self._unloaded.discard(cmd_name)
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: "Context") -> list[str]:
        """The commands this install can run: one whose extra is missing is left out of the list (the
        help page names it, with the extra, after the list)."""
        return [name for name in super().list_commands(ctx) if name not in self._not_installed()]

    def _not_installed(self) -> dict[str, str]:
        """Command name -> a package it needs that this install lacks."""
        return {
            name: missing
            for name, lazy in self.lazy_commands.items()
            if name in self._unloaded and (missing := lazy.missing()) is not None
        }

    def format_help(self, ctx: "Context", formatter: "HelpFormatter") -> None:
        """The help page lists the placeholders as they are: it imports no command's module."""
        self._listing = True
        try:
            super().format_help(ctx, formatter)
            absent = self._not_installed()
            extras = sorted({EXTRA_OF.get(package, package) for package in absent.values()})
            if absent:
                formatter.write_paragraph()
                formatter.write_text(
                    f"Not in this install: {', '.join(sorted(absent))} (pip install "
                    + " / ".join(f"'crowdtrain[{extra}]'" for extra in extras)
                    + ")."
                )
        finally:
            self._listing = False

    def shell_complete(self, ctx: "Context", incomplete: str) -> list[Any]:
        """Completing a command's name offers the placeholders with their help: it imports no
        command's module (completing a command's own options imports that command alone)."""
        self._listing = True
        try:
            return super().shell_complete(ctx, incomplete)
        finally:
            self._listing = False
