"""What several command groups share: how help pages are laid out, the scheduler's URL, the log set-up and
the join token a client or peer registers with, and the project key it pins."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from crowdtrain.core import logs, signing
from crowdtrain.core.settings import CLIENT_JOIN_TOKEN_ENV, get_settings

if TYPE_CHECKING:
    # Typer vendors Click as its private `typer._click`: the override below takes its Context.
    from typer._click import Context

# Click's plain help layout, with every default shown: an option's description gets what is left of the
# terminal after a name column of at most 30 characters, where typer's rich panels give the option names,
# negative flags and types a column each and leave the description some 18 characters at 80 columns.
HELP_LAYOUT: dict[str, Any] = {"rich_markup_mode": None, "context_settings": {"show_default": True}}


class ArgumentsCommand(TyperCommand):
    """A command that takes arguments (`@app.command(cls=ArgumentsCommand)`), each with a metavar and help:
    its usage line writes a required one `JOB_ID`, as click and man pages do, where typer writes `{JOB_ID}`."""

    def collect_usage_pieces(self, ctx: "Context") -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


# The scheduler's URL, for every command that talks to one.
SERVER_ENV = "CROWDTRAIN_SERVER"
DEFAULT_SERVER = "http://127.0.0.1:8000"
ServerOpt = Annotated[str, typer.Option(envvar=SERVER_ENV, show_envvar=True, help="Scheduler URL")]
OptionalServerOpt = Annotated[
    str | None, typer.Option(envvar=SERVER_ENV, show_envvar=True, show_default=False, help="Scheduler URL")
]

# The volunteer client's cache, for the commands that run the client or look at it.
DEFAULT_CACHE = Path("~/.cache/crowdtrain")
CacheOpt = Annotated[Path, typer.Option(help="Cache of shards, snapshots, the host token and the status file")]


def configure_logging(level: str = "INFO") -> None:
    logs.configure(get_settings().log_format, level)


# The join token is a secret: from the environment or a file, it stays out of `ps`.
JOIN_TOKEN_ENV = CLIENT_JOIN_TOKEN_ENV
JoinTokenOpt = Annotated[
    str | None,
    typer.Option(
        envvar=JOIN_TOKEN_ENV,
        show_envvar=True,
        show_default=False,
        help=f"Join token from the project operator (visible in `ps`: prefer {JOIN_TOKEN_ENV} or --join-token-file)",
    ),
]
JoinTokenFileOpt = Annotated[Path | None, typer.Option(help="File holding the join token", show_default=False)]


def resolve_join_token(token: str | None, token_file: Path | None) -> str:
    """The join token from --join-token / CROWDTRAIN_CLIENT_JOIN_TOKEN or --join-token-file (exactly one)."""
    if token and token_file is not None:
        raise typer.BadParameter(
            f"give the join token once: --join-token (or {JOIN_TOKEN_ENV}) or --join-token-file",
            param_hint="--join-token-file",
        )
    if token_file is not None:
        try:
            token = token_file.expanduser().read_text().strip()
        except OSError as exc:
            raise typer.BadParameter(
                f"cannot read {token_file}: {exc.strerror}", param_hint="--join-token-file"
            ) from exc
        if not token:
            raise typer.BadParameter(f"{token_file} is empty", param_hint="--join-token-file")
    if not token:
        raise typer.BadParameter(
            f"required: --join-token-file, {JOIN_TOKEN_ENV} or --join-token", param_hint="--join-token"
        )
    return token


ProjectKeyOpt = Annotated[
    str | None,
    typer.Option(
        help="The project's public key (its project.pub file, or the key itself) to pin when joining: only "
        "work it signs is run (default: the key the scheduler names at registration, trust on first use)",
        show_default=False,
    ),
]


def resolve_project_key(given: str) -> str:
    """--project-key as a public key: a file holding one (project.pub), or the key's text."""
    path = Path(given).expanduser()
    try:
        text = path.read_text(errors="replace") if path.is_file() else given
        return signing.check_public_key(text[:1000])
    except (OSError, signing.NotAKey) as exc:
        raise typer.BadParameter(f"not a project public key file or value: {exc}", param_hint="--project-key") from None
