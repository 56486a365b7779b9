"""The job spec's reference page, rendered from the pydantic models' JSON schema: one table per section
(field, type, default, description), the nested sections and each zoo model's options in sections of
their own. The page is docs/reference/job-spec.md; a test renders it again and compares.

    python -m crowdtrain.core.spec_reference docs/reference/job-spec.md    (or `make docs-reference`)
"""

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from crowdtrain.core.jobspec import JobSpec
from crowdtrain.core.modelspec import ZOO_OPTIONS

PAGE = Path("docs/reference/job-spec.md")
COMMAND = "make docs-reference"

INTRO = f"""# Job spec reference

<!-- Generated from crowdtrain.core.jobspec's JSON schema by `{COMMAND}`; do not edit by hand. -->

A job spec is a YAML or JSON file that `crowdtrain job submit` validates against these models. A key
that a section does not know is refused, so a misspelt key never falls back to the default silently.
A type `X or null` takes `null` for "none". A field whose default is *required* must be given.
The [jobs page](../operator/jobs.md#job-spec) explains the sections in prose, and
[Choosing a mode and a merge rule](../operator/choosing-a-mode.md) says which settings trained here.
"""

# Keywords of a JSON schema that bound a value, and how a reader writes each.
BOUNDS = {"minimum": "≥", "exclusiveMinimum": ">", "maximum": "≤", "exclusiveMaximum": "<"}
LENGTHS = {"minLength": "length ≥", "maxLength": "length ≤", "minItems": "items ≥", "maxItems": "items ≤"}


def anchor(title: str) -> str:
    """The id MkDocs gives the heading `title` (Python-Markdown's toc slugify: word characters, spaces and
    hyphens kept, runs of spaces and hyphens made one hyphen, lower case)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def cell(text: str) -> str:
    """`text` made safe for one Markdown table cell: no line breaks, pipes, emphasis or tags."""
    return " ".join(text.split()).replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def type_of(schema: dict[str, Any], titles: dict[str, str]) -> str:
    """A field's type as a reader writes it, bounds included: `integer (≥ 1, ≤ 1000)`, `"sgd" | "adam"`."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{titles[name]}](#{anchor(titles[name])})"
    if "anyOf" in schema or "oneOf" in schema:  # oneOf: a union of sections told apart by one key
        return " or ".join(type_of(option, titles) for option in schema.get("anyOf") or schema["oneOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "any")
    if kind == "array" and "prefixItems" in schema:
        kind = "[" + ", ".join(type_of(item, titles) for item in schema["prefixItems"]) + "]"
    elif kind == "array" and "items" in schema:
        kind = f"list of {type_of(schema['items'], titles)}"
    elif kind == "object":
        kind = "mapping"
    bounds = [f"{word} {schema[key]}" for key, word in {**BOUNDS, **LENGTHS}.items() if key in schema]
    if kind.startswith("["):  # a tuple's length is in its brackets already
        bounds = [b for b in bounds if not b.startswith("items")]
    return f"{kind} ({', '.join(bounds)})" if bounds else kind


def default_of(name: str, schema: dict[str, Any], required: list[str], titles: dict[str, str]) -> str:
    if name in required:
        return "*required*"
    if "default" in schema:
        return f"`{json.dumps(schema['default'], ensure_ascii=False)}`"
    if "$ref" in schema:  # a section made by its own defaults
        return "its section's defaults"
    if "oneOf" in schema:
        return "the first section's defaults (the default configuration)"
    return "`{}`" if schema.get("type") == "object" else "empty"


def section(title: str, schema: dict[str, Any], titles: dict[str, str], lead: str = "") -> list[str]:
    """One section of the page: its heading, what it is, and a row per field."""
    lines = [f"## {title}", ""]
    for text in (lead, schema.get("description", "")):
        if text:
            lines += [" ".join(text.split()), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    required = schema.get("required", [])
    for name, field in schema.get("properties", {}).items():
        row = [
            f"`{name}`",
            type_of(field, titles),
            default_of(name, field, required, titles),
            cell(field.get("description", "")),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def sections(schema: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """(titles, defs) of the schema's nested models: each one's section title by its name in `defs`,
    where it sits in a spec (`assimilation.upload`), in the order a reader meets them (a section's own
    sections follow it); and `defs`, the schemas of the sections (`schema` is left as it is).

    A union of sections told apart by one key (`assimilation`, by `rule`) gets a section of the keys
    they all share, then one per value of the key with the rest: `defs` holds the shared section, and
    each of the union's sections without the shared keys."""
    defs = copy.deepcopy(schema["$defs"])
    return _titles(schema, defs, "", {}), defs


def _titles(node: dict[str, Any], defs: dict[str, Any], path: str, titles: dict[str, str]) -> dict[str, str]:
    """`titles` with those of `node`'s sections at `path` added; a union's shared section added to `defs`."""
    for name, field in node.get("properties", {}).items():
        key = field.get("discriminator", {}).get("propertyName")
        options = [field, *field.get("anyOf", []), *field.get("oneOf", [])]
        refs = [r["$ref"].rsplit("/", 1)[-1] for r in options if "$ref" in r]
        refs = [r for r in refs if r not in titles]
        if key and len(refs) > 1:
            shared = f"{path}{name} (every {key})"
            defs[shared] = _split_shared(defs, refs, key, shared)
            titles[shared] = shared
            _titles(defs[shared], defs, f"{path}{name}.", titles)
        for ref in refs:
            titles[ref] = f"{path}{name} ({key} {defs[ref]['properties'][key]['const']})" if key else f"{path}{name}"
            _titles(defs[ref], defs, f"{path}{name}.", titles)
    return titles


def _split_shared(defs: dict[str, Any], refs: list[str], key: str, title: str) -> dict[str, Any]:
    """The schema of the fields every one of `refs` has alike (but `key`), taken out of each of them."""
    first = defs[refs[0]]["properties"]
    shared = {n: f for n, f in first.items() if n != key and all(defs[r]["properties"].get(n) == f for r in refs)}
    for ref in refs:
        defs[ref]["properties"] = {n: f for n, f in defs[ref]["properties"].items() if n not in shared}
        defs[ref]["description"] = f"{defs[ref].get('description', '')} With the keys of [{title}](#{anchor(title)})."
    return {"description": f"The keys every section has, whatever its {key}.", "properties": shared}


def render(spec: type[BaseModel] = JobSpec) -> str:
    """The whole reference page, as Markdown."""
    schema = spec.model_json_schema()
    titles, defs = sections(schema)
    lines = [INTRO, *section("Top level", schema, titles, "The keys of the spec file itself.")]
    for name, title in titles.items():
        lines += section(title, defs[name], titles)
    for model, options in ZOO_OPTIONS.items():
        lead = f"The keys of `model.options` when `model.name` is `{model}`."
        lines += section(f"model.options ({model})", options.model_json_schema(), titles, lead)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m crowdtrain.core.spec_reference {PAGE}", file=sys.stderr)
        return 2
    target = Path(argv[0])
    try:
        target.write_text(render())
    except OSError as exc:
        print(f"{target}: cannot write it: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
