"""docker-compose.yml and .env.example agree with each other, with the Dockerfiles and with the code.

No Docker engine is needed: the compose file is read as YAML, interpolated the way Compose does it,
and its commands are parsed by the real `crowdtrain` command line.
"""

import re
from urllib.parse import urlparse

import click
import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from crowdtrain.cli import app
from crowdtrain.core.settings import Settings
from crowdtrain.server.services.health import TTL_SECONDS
from tests.compose_files import (
    COMPOSE_FILE,
    ENV_EXAMPLE,
    LISTED,
    ROOT,
    SECRETS,
    argv,
    compose_variables,
    dockerfile_entrypoint,
    env_example,
    environment,
    example_values,
    filled_in,
    interpolate,
    load_compose,
)

SERVER_SERVICES = ("migrate", "scheduler", "assimilator", "transitioner")
REQUIRED_SERVICES = ("postgres", "redis", "minio", "createbucket", *SERVER_SERVICES, "client")
DATA_DIRS = {"postgres": "/var/lib/postgresql/data", "redis": "/data", "minio": "/data"}


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
        if LISTED.fullmatch(line.strip()):
            above = lines[i - 1] if i else ""
            assert above.startswith("# ") and not LISTED.fullmatch(above), (
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
