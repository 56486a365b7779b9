"""Every dotted name of this project that a docstring or a comment writes resolves.

Docstrings and comments point the reader at code by its dotted name (crowdtrain.server.ledger.epochs.
next_epoch_releasable, crowdtrain.sim.job.SimJob.shard_key); when the code moves, the name goes stale
and misleads. A name counts when it starts with a top-level package of the project as installed
(`crowdtrain.`) or as the repository lays it out (`server.`, `client.`, `assimilator.`, `workgen.`,
`migrations.`, each `crowdtrain.` + that). It resolves when its longest importable prefix is a module
and the rest are attributes of it (a class's field counts), with an optional trailing `()`.

Docstrings are read with ast and comments with tokenize; nothing is imported until a name asks for
it, and each module once.
"""

import ast
import importlib
import io
import re
import tokenize
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("crowdtrain", "server", "client", "assimilator", "workgen", "migrations", "benchmarks", "tests")
# The folders pyproject.toml's [tool.setuptools.package-dir] maps under `crowdtrain.`.
TOP_LEVEL = ("crowdtrain", "server", "client", "assimilator", "workgen", "migrations")
DOTTED = re.compile(r"(?<![\w./-])(?:{})(?:\.[A-Za-z_]\w*)+".format("|".join(TOP_LEVEL)))
# A file's name (`client.lock`, `server.log`) is not a dotted name of the code.
FILE_SUFFIXES = {"lock", "log", "py", "json", "yaml", "yml", "toml", "txt", "md", "npz", "safetensors", "trace", "pid"}


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each docstring and comment of a Python file."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def _names(text: str) -> set[str]:
    return {m.group() for m in DOTTED.finditer(text) if m.group().rsplit(".", 1)[1] not in FILE_SUFFIXES}


@cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _has(obj: object, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    fields: set[str] = set(getattr(obj, "model_fields", {})) | set(getattr(obj, "__dataclass_fields__", {}))
    for klass in getattr(obj, "__mro__", ()):
        fields |= set(getattr(klass, "__annotations__", {}))
    return attr in fields


@cache
def resolves(name: str) -> bool:
    parts = name.split(".")
    if parts[0] != "crowdtrain":
        parts = ["crowdtrain", *parts]
    for cut in range(len(parts), 1, -1):
        obj: object = _module(".".join(parts[:cut]))
        if obj is None:
            continue
        for attr in parts[cut:]:
            if not _has(obj, attr):
                return False
            obj = getattr(obj, attr, None)
        return True
    return False


@cache
def written_names() -> dict[str, list[str]]:
    """Each dotted name of the project written in a docstring or comment -> where (path:line)."""
    where: dict[str, list[str]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, text in _texts(path):
                for name in _names(text):
                    where.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{line}")
    return where


def test_the_scan_finds_names_and_refuses_a_stale_one(tmp_path: Path) -> None:
    code = tmp_path / "m.py"
    code.write_text('"""Module: crowdtrain.a."""\n\n\ndef f():\n    """crowdtrain.b"""\n    return 1  # crowdtrain.c\n')
    assert set().union(*(_names(text) for _, text in _texts(code))) == {"crowdtrain.a", "crowdtrain.b", "crowdtrain.c"}
    assert "crowdtrain.sim.servers" in written_names(), "crowdtrain/sim/training.py's docstring names it"
    assert _names(
        "see crowdtrain.sim.job.SimJob.shard_key() and server.ledger.epochs, not x.client.y or client.lock"
    ) == {
        "crowdtrain.sim.job.SimJob.shard_key",
        "server.ledger.epochs",
    }
    assert resolves("crowdtrain.sim.job.SimJob.shard_key") and resolves("server.ledger.epochs")
    assert resolves("crowdtrain.core.jobspec.JobSpec.stop"), "a pydantic field is an attribute"
    assert not resolves("crowdtrain.sim.job.SimJob.no_such_method")
    assert not resolves("crowdtrain.server.services.no_such_module")


def test_every_dotted_name_in_docstrings_and_comments_resolves() -> None:
    stale = {name: where for name, where in written_names().items() if not resolves(name)}
    assert not stale, "names that do not resolve (moved or gone):\n" + "\n".join(
        f"  {name}  ({', '.join(where)})" for name, where in sorted(stale.items())
    )
