"""docker-compose.yml, .env.example and the Dockerfiles read as Compose and Docker read them: the
compose file parsed as YAML and interpolated with Compose's rules, the variables .env.example lists,
a service's environment and the process it runs. Shared by the compose and image tests."""

import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"

# `$$` is a literal `$`; `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `$VAR`.
_VARIABLE = re.compile(r"\$\$|\$\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_]\w*)")


def compose_variables(value: Any) -> set[str]:
    """Every variable interpolated in a parsed compose document (comments are not interpolated)."""
    if isinstance(value, dict):
        return set().union(*(compose_variables(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(compose_variables(v) for v in value))
    if isinstance(value, str):
        return {m["braced"] or m["bare"] for m in _VARIABLE.finditer(value) if m.group() != "$$"}
    return set()


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation of every string in a parsed compose document."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match) -> str:
        if m.group() == "$$":
            return "$"
        name, op, arg = m["braced"] or m["bare"], m["op"], m["arg"]
        current = env.get(name)
        missing = current is None or (op is not None and op.startswith(":") and current == "")
        if op is not None and op.endswith("?") and missing:
            raise KeyError(f"{name}: {arg}")
        if op is not None and op.endswith("-") and missing:
            return arg
        return current or ""

    return _VARIABLE.sub(substitute, value)


def load_compose(env: dict[str, str]) -> dict:
    """docker-compose.yml, interpolated with `env`."""
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env)


LISTED = re.compile(r"(#\s*)?([A-Z_][A-Z0-9_]*)=(.*)")


def env_example() -> dict[str, str | None]:
    """The variables .env.example lists: `NAME=value` sets one, a commented-out `# NAME=value` keeps the default."""
    listed = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if m := LISTED.fullmatch(line.strip()):
            listed[m[2]] = None if m[1] else m[3]
    return listed


def example_values() -> dict[str, str]:
    """What `cp .env.example .env` gives Compose."""
    return {k: v for k, v in env_example().items() if v is not None}


SECRETS = ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "CROWDTRAIN_ADMIN_TOKEN", "CROWDTRAIN_JOIN_TOKEN")


def filled_in() -> dict[str, str]:
    """.env.example with every secret set, as the operator leaves it."""
    return example_values() | {name: f"{name.lower()}-secret" for name in SECRETS}


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def argv(service: dict, entrypoint: list[str] | None = None) -> list[str]:
    """The process a service runs: its entrypoint (compose's, else the image's) followed by its command."""
    command = service.get("command") or []
    command = shlex.split(command) if isinstance(command, str) else list(command)
    entry = service.get("entrypoint", entrypoint) or []
    return (shlex.split(entry) if isinstance(entry, str) else list(entry)) + command


def dockerfile_entrypoint(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    return json.loads(lines[-1].removeprefix("ENTRYPOINT")) if lines else []
