"""Reading an operator's spec file: bounded in size before it is read, and in YAML alias expansion
before it is constructed, so that a few hundred bytes cannot expand into gigabytes; and the base of
the sections it is validated into."""

import re
from itertools import accumulate
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

MAX_SPEC_BYTES = 1024 * 1024
# Nodes of the document with every alias expanded: a plain 1 MiB file has at most about this many,
# while a "billion laughs" file of 588 bytes has 10^9.
MAX_SPEC_NODES = 500_000
# PyYAML's scanner takes time quadratic in the nesting of [ and {, and its composer recurses.
MAX_FLOW_DEPTH = 100


class SpecSection(BaseModel):
    """A section of a spec file: a key it does not know is refused (a misspelt key would otherwise
    fall back to the default silently)."""

    model_config = ConfigDict(extra="forbid")


class SpecFileError(ValueError):
    """The file cannot be read as a spec: the message is one line naming the file and the problem."""


def read_bounded(path: Path, limit: int) -> str:
    """The text of `path`, refusing a file over `limit` bytes without reading more than that."""
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise SpecFileError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > limit:
        raise SpecFileError(f"{path}: larger than the limit of {limit} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def flow_depth(text: str) -> int:
    """The deepest nesting of [ ] and { } in `text`, counting brackets inside quoted strings too
    (an overestimate only for text with many unbalanced brackets in strings)."""
    return max(accumulate((1 if c in "[{" else -1 for c in re.findall(r"[][{}]", text)), initial=0))


def expanded_size(node: yaml.Node, limit: int) -> int:
    """How many nodes the composed document has once every alias is expanded, counted without
    expanding anything (an alias is the same node object reached twice); stops past `limit`."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) not in sizes:
            if isinstance(n, yaml.MappingNode):
                children = [c for pair in n.value for c in pair]
            elif isinstance(n, yaml.SequenceNode):
                children = n.value
            else:
                children = []
            total = 1
            for child in children:
                total += size(child)
                if total > limit:
                    break
            sizes[id(n)] = total
        return sizes[id(n)]

    return size(node)


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing documents that expand past MAX_SPEC_NODES nodes."""

    def construct_document(self, node: yaml.Node) -> Any:
        if expanded_size(node, MAX_SPEC_NODES) > MAX_SPEC_NODES:
            raise SpecFileError(
                f"YAML aliases expand to more than {MAX_SPEC_NODES} nodes; "
                "a job spec needs no more (write the values out instead)"
            )
        return super().construct_document(node)


def load_yaml(path: Path) -> Any:
    """The YAML (or JSON) document in `path`; raises SpecFileError with a one-line message."""
    text = read_bounded(path, MAX_SPEC_BYTES)
    if flow_depth(text) > MAX_FLOW_DEPTH:
        raise SpecFileError(f"{path}: [ ] and {{ }} nested more than {MAX_FLOW_DEPTH} deep")
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except SpecFileError as exc:
        raise SpecFileError(f"{path}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        where = exc.problem_mark or exc.context_mark
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise SpecFileError(f"{path}: not valid YAML: {exc.problem or exc.context}{at}") from None
    except yaml.YAMLError as exc:
        raise SpecFileError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise SpecFileError(f"{path}: nested too deeply") from None
