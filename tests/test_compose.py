"""docker-compose.yml, the Dockerfiles and .env.example agree with each other and with the code.

No Docker engine is needed: the compose file is read as YAML, interpolated the way Compose does it,
and its commands are parsed by the real `crowdtrain` command line.
"""

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import click
import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from crowdtrain.cli import app
from crowdtrain.core.settings import Settings
from crowdtrain.server.services.health import TTL_SECONDS

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SERVER_SERVICES = ("migrate", "scheduler", "assimilator", "transitioner")
REQUIRED_SERVICES = ("postgres", "redis", "minio", "createbucket", *SERVER_SERVICES, "client")
DATA_DIRS = {"postgres": "/var/lib/postgresql/data", "redis": "/data", "minio": "/data"}

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


_LISTED = re.compile(r"(#\s*)?([A-Z_][A-Z0-9_]*)=(.*)")


def env_example() -> dict[str, str | None]:
    """The variables .env.example lists: `NAME=value` sets one, a commented-out `# NAME=value` keeps the default."""
    listed = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if m := _LISTED.fullmatch(line.strip()):
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


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose(filled_in())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def test_every_required_service_is_defined(services: dict) -> None:
    assert set(REQUIRED_SERVICES) <= set(services)


def long_running(services: dict) -> list[str]:
    """The services compose restarts, but the volunteer client: what other services may wait for."""
    return [name for name, service in services.items() if service.get("restart", "no") != "no" and name != "client"]


def test_the_long_running_services_are_the_backing_and_server_processes(services: dict) -> None:
    assert sorted(long_running(services)) == sorted(["postgres", "redis", "minio", *SERVER_SERVICES[1:]])


@pytest.mark.parametrize("name", ["postgres", "redis", "minio", *SERVER_SERVICES[1:]])
def test_every_long_running_service_has_a_healthcheck(services: dict, name: str) -> None:
    test = services[name].get("healthcheck", {}).get("test")
    assert test and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, test


@pytest.mark.parametrize(("name", "kind"), [("assimilator", "parameter-server"), ("transitioner", "transitioner")])
def test_server_processes_check_their_own_health_record_with_the_cli(services: dict, name: str, kind: str) -> None:
    """The healthcheck runs `crowdtrain health --local-process KIND` in the service's own image; the command
    and its options exist (parsed by the real command line, and its help printed)."""
    test = services[name]["healthcheck"]["test"]
    assert test == ["CMD", "crowdtrain", "health", "--local-process", kind], test
    _parse_cli(test[2:])
    shown = CliRunner().invoke(app, [*test[2:], "--help"])
    assert shown.exit_code == 0 and "--local-process" in shown.output, shown.output
    # The record lapses after its time-to-live: the check must not wait much longer before it says so.
    assert _seconds(services[name]["healthcheck"]["interval"]) <= TTL_SECONDS


def test_the_scheduler_healthcheck_probes_the_health_route_with_python(services: dict) -> None:
    test = services["scheduler"]["healthcheck"]["test"]
    assert test[1] == "python" and "urllib" in test[-1] and "http://127.0.0.1:8000/v1/health/live" in test[-1]
    compile(test[-1], "<healthcheck>", "exec")


@pytest.mark.parametrize("name", sorted(DATA_DIRS))
def test_stateful_services_keep_their_data_in_named_volumes(compose: dict, services: dict, name: str) -> None:
    mounts = dict(v.split(":")[:2] for v in services[name].get("volumes", []) if isinstance(v, str))
    volume = next((src for src, dst in mounts.items() if dst == DATA_DIRS[name]), None)
    assert volume is not None, f"{name} has no volume at {DATA_DIRS[name]}"
    assert volume in (compose.get("volumes") or {}), f"{volume} is not a named volume"


def test_redis_persists_the_parameter_store_with_appendonly(services: dict) -> None:
    command = argv(services["redis"])
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes"


def test_minio_serves_the_directory_its_volume_is_mounted_on(services: dict) -> None:
    command = argv(services["minio"])
    assert command[:2] == ["server", DATA_DIRS["minio"]]


@pytest.mark.parametrize(
    "name,dependencies",
    [
        ("migrate", {"postgres": "service_healthy"}),
        ("createbucket", {"minio": "service_healthy"}),
        *[
            (
                name,
                {
                    "migrate": "service_completed_successfully",
                    "redis": "service_healthy",
                    "createbucket": "service_completed_successfully",
                },
            )
            for name in SERVER_SERVICES[1:]
        ],
        (
            "client",
            {"scheduler": "service_healthy", "assimilator": "service_healthy", "transitioner": "service_healthy"},
        ),
    ],
)
def test_services_wait_for_what_they_need(services: dict, name: str, dependencies: dict) -> None:
    depends_on = services[name].get("depends_on") or {}
    assert isinstance(depends_on, dict), f"{name}: depends_on needs conditions"
    assert {dep: depends_on.get(dep, {}).get("condition") for dep in dependencies} == dependencies


def test_every_healthy_condition_names_a_service_with_a_healthcheck(services: dict) -> None:
    for name, service in services.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"


def test_one_shot_services_are_not_restarted(services: dict) -> None:
    for name in ("migrate", "createbucket"):
        assert services[name].get("restart", "no") == "no", name


def test_the_client_runs_only_under_its_profile(services: dict) -> None:
    assert services["client"].get("profiles") == ["client"]
    assert [n for n, s in services.items() if s.get("profiles") and n != "client"] == []


def test_the_assimilator_scales_by_replicas(services: dict) -> None:
    assert int(services["assimilator"]["deploy"]["replicas"]) >= 1
    assert "container_name" not in services["assimilator"], "a fixed container name cannot be replicated"


def test_every_server_crowdtrain_variable_is_a_settings_field(services: dict) -> None:
    fields = {f"CROWDTRAIN_{name.upper()}" for name in Settings.model_fields}
    used = {k for name in SERVER_SERVICES for k in environment(services[name]) if k.startswith("CROWDTRAIN_")}
    assert used, "no CROWDTRAIN_* variable at all"
    assert used - fields == set(), f"not fields of crowdtrain.core.settings.Settings: {sorted(used - fields)}"


def test_the_client_takes_its_join_token_from_the_environment_not_its_command_line(services: dict) -> None:
    client = typer.main.get_command(app).get_command(click.Context(typer.main.get_command(app)), "client")
    envvars = {p.envvar for p in client.params if p.envvar}
    env = environment(services["client"])
    assert set(env) <= envvars, f"not read by `crowdtrain client`: {sorted(set(env) - envvars)}"
    assert env["CROWDTRAIN_CLIENT_JOIN_TOKEN"] == "crowdtrain_join_token-secret"
    assert "--join-token" not in argv(services["client"])


@pytest.mark.parametrize("secret", SECRETS)
def test_env_example_ships_no_secret_and_compose_refuses_to_run_without_it(secret: str) -> None:
    assert env_example()[secret] == "", f".env.example ships a value for {secret}"
    with pytest.raises(KeyError, match=secret):
        load_compose(filled_in() | {secret: ""})


def test_server_processes_share_one_environment_and_image(services: dict) -> None:
    first = services[SERVER_SERVICES[0]]
    for name in SERVER_SERVICES:
        assert environment(services[name]) == environment(first), name
        assert services[name]["image"] == first["image"]
        assert services[name]["build"]["dockerfile"] == "Dockerfile"
    assert services["client"]["build"]["dockerfile"] == "Dockerfile.client"


def test_server_urls_name_the_compose_services(services: dict) -> None:
    env = environment(services["scheduler"])
    assert urlparse(env["CROWDTRAIN_DATABASE_URL"]).hostname == "postgres"
    assert urlparse(env["CROWDTRAIN_REDIS_URL"]).hostname == "redis"
    assert urlparse(env["CROWDTRAIN_S3_ENDPOINT_URL"]).hostname == "minio"
    storage = urlparse(env["CROWDTRAIN_STORAGE_URL"])
    assert storage.scheme == "s3"
    # createbucket makes the very bucket the servers write to.
    assert f"/{storage.netloc}" in " ".join(argv(services["createbucket"]))


def test_server_s3_credentials_are_minio_root_credentials(services: dict) -> None:
    server, minio = environment(services["scheduler"]), environment(services["minio"])
    assert server["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
    assert server["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
    assert server["AWS_DEFAULT_REGION"]


# Variables Compose itself reads from .env, not interpolated in the file.
COMPOSE_OWN = {"COMPOSE_PROJECT_NAME"}


def test_every_interpolated_variable_is_listed_in_env_example() -> None:
    used = compose_variables(yaml.safe_load(COMPOSE_FILE.read_text())) | COMPOSE_OWN
    listed = set(env_example())
    assert used - listed == set(), f"missing from .env.example: {sorted(used - listed)}"
    assert listed - used == set(), f"listed in .env.example but unused: {sorted(listed - used)}"


def test_every_env_example_variable_has_a_comment() -> None:
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if _LISTED.fullmatch(line.strip()):
            above = lines[i - 1] if i else ""
            assert above.startswith("# ") and not _LISTED.fullmatch(above), (
                f".env.example line {i + 1} ({line}) has no comment line above it"
            )


def test_both_compose_generations_accept_the_file(compose: dict) -> None:
    """docker-compose 1.29 (the Python v1) refuses a top-level `name:` and knows no other top-level keys
    than these; the project is named by COMPOSE_PROJECT_NAME in .env instead, which v1 and v2 both read."""
    assert set(compose) <= {"services", "volumes", "networks", "secrets", "configs"} | {
        k for k in compose if k.startswith("x-")
    }, sorted(compose)
    assert example_values()["COMPOSE_PROJECT_NAME"] == "crowdtrain"


def test_the_production_file_builds_the_default_images_on_the_default_network(services: dict) -> None:
    """Build arguments and host networking belong to `make compose-test`'s override, never to production."""
    for name, service in services.items():
        assert "network_mode" not in service, name
        assert "args" not in (service.get("build") or {}), name
    assert services["postgres"]["image"] == "postgres:16" and services["redis"]["image"] == "redis:7"
    assert services["minio"]["image"] == "minio/minio" and services["createbucket"]["image"] == "minio/mc"


def test_every_service_keeps_a_rotated_log(services: dict) -> None:
    for name, service in services.items():
        logging = service.get("logging") or {}
        assert logging.get("driver") == "json-file" and {"max-size", "max-file"} <= set(logging["options"]), name


TEST_OVERRIDE = ROOT / "tests" / "compose" / "docker-compose.test.yml"
PULLED = {"postgres", "redis", "minio", "createbucket"}  # the services whose images come from a registry


def test_the_compose_test_override_replaces_only_what_cannot_be_pulled(services: dict) -> None:
    """`make compose-test`'s override: registry images become the local stand-in, the project's images keep
    their names and Dockerfiles and only gain build arguments, and every service joins the host's network."""
    override = interpolate(yaml.safe_load(TEST_OVERRIDE.read_text()), filled_in())["services"]
    assert set(override) == set(services)
    for name, service in override.items():
        assert service["network_mode"] == "host", name
        if name in PULLED:
            assert service["image"] == "crowdtrain-compose-backing", name
        else:
            assert "image" not in service, f"{name}: the override keeps the project's image"
            assert set(service["build"]) == {"network", "args"}, name
            assert service["build"]["args"]["BASE_IMAGE"] == "crowdtrain-compose-base:bookworm"
    # The server processes differ from production in their addresses alone.
    for name in SERVER_SERVICES:
        assert set(environment(override[name])) <= {*environment(services[name]), "CROWDTRAIN_SERVER"}, name


def test_make_compose_test_runs_the_script_and_stays_out_of_make_test_and_ci() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ncompose-test:", 1)[1].split("\n\n", 1)[0]
    assert "tests/compose/compose-test.sh" in recipe
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "compose" not in test_recipe
    assert "compose-test" not in (ROOT / ".ci" / "run").read_text()
    assert "make compose-test" in (ROOT / "docs" / "operator" / "deploy.md").read_text()


def test_required_variables_fail_loudly_when_unset() -> None:
    with pytest.raises(KeyError, match="POSTGRES_PASSWORD"):
        load_compose({})


def _seconds(duration: str) -> float:
    """A compose duration such as `15s`, `1m30s` or `500ms`, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def _parse_cli(args: list[str]) -> None:
    """Parse (not run) a `crowdtrain` command line, as click would: unknown options raise UsageError."""
    group = typer.main.get_command(app)
    name, *rest = args
    command = group.get_command(click.Context(group), name)
    assert command is not None, f"no command {name!r}"
    command.make_context(name, rest)


@pytest.mark.parametrize("name", [*SERVER_SERVICES, "client"])
def test_service_commands_are_valid_crowdtrain_command_lines(services: dict, name: str) -> None:
    entrypoint = dockerfile_entrypoint(ROOT / services[name]["build"]["dockerfile"])
    command = argv(services[name], entrypoint)
    assert command[0] == "crowdtrain", command
    _parse_cli(command[1:])


def test_the_scheduler_serves_on_all_interfaces_without_migrating(services: dict) -> None:
    command = argv(services["scheduler"])
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert "--no-migrate" in command
    assert any(p.endswith(":8000") for p in services["scheduler"]["ports"])


def _pip_installs(dockerfile: Path) -> list[str]:
    text = dockerfile.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if line.startswith("RUN") and "pip install" in line]


def test_the_client_image_installs_the_client_extra_only() -> None:
    installs = " ".join(_pip_installs(ROOT / "Dockerfile.client"))
    assert '".[${CLIENT_EXTRAS}]"' in installs and _args(ROOT / "Dockerfile.client")["CLIENT_EXTRAS"] == "client"
    assert "[server]" not in installs and "[dev]" not in installs
    assert dockerfile_entrypoint(ROOT / "Dockerfile.client") == ["crowdtrain"]


def test_the_server_image_installs_the_server_tensorflow_and_data_extras() -> None:
    # Parameter servers evaluate TensorFlow jobs and Keras JSON models with TensorFlow; the scheduler
    # reads every dataset format at submission.
    installs = " ".join(_pip_installs(ROOT / "Dockerfile"))
    assert ".[server,tensorflow,data]" in installs and "[dev]" not in installs


def _args(dockerfile: Path) -> dict[str, str]:
    """The build arguments a Dockerfile declares, with their defaults."""
    args = {}
    for line in dockerfile.read_text().splitlines():
        if line.startswith("ARG "):
            name, _, default = line.removeprefix("ARG ").partition("=")
            args[name.strip()] = default.strip()
    return args


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_images_install_the_makefiles_torch_cpu_build_first(dockerfile: str) -> None:
    pinned = re.search(r"torch==[\w.]+", (ROOT / "Makefile").read_text()).group()
    installs = _pip_installs(ROOT / dockerfile)
    assert pinned in installs[0] and '--index-url "$TORCH_INDEX_URL"' in installs[0], installs
    # Production builds take the CPU-only build from PyTorch's index unless told otherwise.
    assert _args(ROOT / dockerfile)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_images_build_on_the_official_python_image_unless_told_otherwise(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    assert _args(ROOT / dockerfile)["BASE_IMAGE"] == "python:3.11-slim"
    froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert froms and set(froms) == {"${BASE_IMAGE}"}, froms
    # Pip installs into a virtual environment (Debian's own Python refuses system installs, PEP 668),
    # which the image's PATH puts first, so `crowdtrain` and `python` are the environment's.
    assert "python3 -m venv /opt/venv" in text and "PATH=/opt/venv/bin:$PATH" in text


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_images_take_wheels_from_the_wheelhouse_but_do_not_keep_them(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    assert "COPY wheelhouse /wheelhouse" in text
    assert all("--find-links /wheelhouse" in line for line in _pip_installs(ROOT / dockerfile))
    # The final stage copies the virtual environment alone, not the wheelhouse or the sources.
    final_stage = text.rsplit("\nFROM ", 1)[1]
    assert "COPY --from=build /opt/venv /opt/venv" in final_stage and "wheelhouse" not in final_stage


def test_the_wheelhouse_ships_empty() -> None:
    """Production builds find nothing there: git keeps its README alone."""
    assert (ROOT / "wheelhouse" / "README.md").is_file()
    assert "wheelhouse/*.whl" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_client_image_has_a_tensorflow_variant() -> None:
    assert _args(ROOT / "Dockerfile.client")["CLIENT_EXTRAS"] == "client"
    assert "CLIENT_EXTRAS=client,tensorflow" in (ROOT / "Dockerfile.client").read_text()
    assert "tensorflow" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _copied(dockerfile: Path) -> set[str]:
    """The build-context paths a Dockerfile's COPY instructions take."""
    sources = set()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY") and "--from" not in line:
            args = [a for a in line.split()[1:] if not a.startswith("--")]
            sources.update(a.rstrip("/") for a in args[:-1])
    return sources


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_each_image_copies_every_package_folder(dockerfile: str) -> None:
    """The wheel is built from every folder of `package-dir`; an image that left one out could not build it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders <= _copied(ROOT / dockerfile)


def test_dockerignore_keeps_what_the_images_copy() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for dockerfile in ("Dockerfile", "Dockerfile.client"):
        for source in _copied(ROOT / dockerfile):
            assert source not in ignored, f"{dockerfile} copies {source}, which .dockerignore leaves out"
    assert {".venv", ".git", ".env", "var"} <= ignored
