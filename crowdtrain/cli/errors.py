"""What a user's mistake prints: one or two lines and a non-zero exit code, not a traceback.

crowdtrain.cli.main runs the command line and turns the failures a user can cause (the scheduler not answering,
the admin token unset, a package of another extra missing, a file that cannot be read) into a
message saying what is wrong and what to do. `crowdtrain --debug ...` (or CROWDTRAIN_DEBUG=1) shows
the traceback instead. Anything else is a defect and keeps its traceback.
"""

import os
from importlib.metadata import PackageNotFoundError, metadata, requires

import typer
from packaging.requirements import Requirement

# Exit codes: refused input or a missing part of the install (as Click's usage errors), a
# scheduler that could not be reached, and a service written whose service manager could not be.
USAGE = 2
UNREACHABLE = 3
NOT_ENABLED = 4

# Modules a command imports under another name than the requirement that installs them: theirs, or
# one that comes with it.
INSTALLED_BY = {"botocore": "boto3", "keras": "tensorflow", "PIL": "pillow"}


def _extra_of() -> dict[str, str]:
    """The extra that installs each package a command may need, read from the install's own metadata
    (pyproject.toml's optional dependencies). A package several extras name is the first one's, as
    they are listed (the smallest: httpx is the client's, boto3 the fleet's); `dev` only tests the
    project. Empty when crowdtrain runs without being installed."""
    try:
        extras = [e for e in metadata("crowdtrain").get_all("Provides-Extra") or [] if e != "dev"]
        declared = [Requirement(line) for line in requires("crowdtrain") or []]
    except PackageNotFoundError:
        return {}
    found: dict[str, str] = {}
    for req in declared:
        extra = next((e for e in extras if req.marker is not None and req.marker.evaluate({"extra": e})), None)
        if extra is not None and req.name != "crowdtrain":
            found.setdefault(req.name.lower().replace("-", "_"), extra)
    return {package: found[carrier] for package, carrier in INSTALLED_BY.items() if carrier in found} | found


EXTRA_OF = _extra_of()


class UserError(Exception):
    """A mistake the command found itself: `str(exc)` says what is wrong and what to do."""

    def __init__(self, message: str, code: int = USAGE):
        super().__init__(message)
        self.code = code


def missing_extra(package: str) -> str:
    extra = EXTRA_OF.get(package)
    where = f"the {extra} extra: pip install 'crowdtrain[{extra}]'" if extra else f"the package {package!r}"
    return f"this command needs {where} (no module named {package!r} here)"


def explain(exc: BaseException) -> tuple[str, int] | None:
    """The message and exit code for a failure the user caused, or None for a defect."""
    if isinstance(exc, UserError):
        return str(exc), exc.code
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return missing_extra(exc.name.split(".")[0]), USAGE
    if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError) and exc.filename:
        return f"{exc.filename}: {exc.strerror}", USAGE
    try:
        import httpx
    except ModuleNotFoundError:
        return None
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return (
            f"cannot reach the scheduler at {_base_url(exc)}: is it running? Start it with `crowdtrain server`, "
            "or name another with --server (CROWDTRAIN_SERVER)",
            UNREACHABLE,
        )
    if isinstance(exc, httpx.TimeoutException):
        return f"the scheduler at {_base_url(exc)} did not answer in time; try again later", UNREACHABLE
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"the scheduler at {_base_url(exc)} closed the connection without answering", UNREACHABLE
    return None


def _base_url(exc: BaseException) -> str:
    try:
        url = exc.request.url  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return "the given address"
    return f"{url.scheme}://{url.netloc.decode()}"


def debugging(argv: list[str]) -> bool:
    """Whether the traceback is wanted: `--debug` before the command's name, or CROWDTRAIN_DEBUG=1."""
    return "--debug" in argv or os.environ.get("CROWDTRAIN_DEBUG", "").strip().lower() in {"1", "true", "yes"}


def report(exc: Exception, argv: list[str]) -> int | None:
    """Print what a user's mistake `exc` means and return the exit code; None (nothing printed) when
    it is a defect or the traceback is wanted (`debugging`)."""
    found = None if debugging(argv) else explain(exc)
    if found is None:
        return None
    message, code = found
    typer.echo(f"error: {message}", err=True)
    typer.echo("(run with `crowdtrain --debug ...` for the traceback)", err=True)
    return code
