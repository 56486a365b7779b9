"""docker-compose.yml's processes, run locally: the same commands and environment, local addresses.

No Docker engine is needed. Each server service's `command` is taken from the compose file as it
stands, the leading `crowdtrain` becomes this interpreter's `-m crowdtrain`, and the compose network's
addresses become local ones: PostgreSQL -> a fresh test database, Redis -> a private redis-server
started with the compose file's own arguments, MinIO -> moto's standalone S3 server with the bucket
created as `createbucket` does. Then two clients started from the `client` service's command train
the example job to its target, downloading shards and snapshots through presigned S3 URLs.
"""

import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import boto3
import httpx
import pytest
import redis

from crowdtrain.launch.cluster import Cluster, Service, free_port, redis_server_binary, scheduler_is_live, wait_for
from tests.compose_files import ROOT, argv, dockerfile_entrypoint, environment, load_compose
from tests.test_training_end_to_end import assert_exact_accounting, submit, wait_finished

pytestmark = pytest.mark.integration

# Values a `.env` would give; the ${VAR:-default}s not named here take the file's defaults
# (SCHEDULER_WORKERS=3, ASSIMILATOR_CONCURRENCY=2, ASSIMILATOR_REPLICAS=1).
DOT_ENV = {
    "POSTGRES_PASSWORD": "unused-the-test-database-has-its-own",
    "MINIO_ROOT_USER": "compose-test",
    "MINIO_ROOT_PASSWORD": "compose-test-secret",
    "CROWDTRAIN_ADMIN_TOKEN": "compose-admin-Vb3nM8qT1xZ6rK4w",
    "CROWDTRAIN_JOIN_TOKEN": "compose-join-Gd7pL2sW9hJ5cY0f",
}
CONTAINER_ONLY = ("CROWDTRAIN_", "AWS_")
PRESIGNED = re.compile(r"[?&](X-Amz-)?Signature=")  # SigV4 or SigV2 query-string authentication


def crowdtrain_process(command: list[str]) -> list[str]:
    assert command[0] == "crowdtrain", command
    return [sys.executable, "-m", "crowdtrain", *command[1:]]


def replace_option(command: list[str], option: str, value: str) -> list[str]:
    i = command.index(option)
    return [*command[: i + 1], value, *command[i + 2 :]]


def localize(value: str, addresses: dict[str, str]) -> str:
    """Rewrite `//service:port` (compose network) to `//127.0.0.1:port` (this machine)."""
    for compose_address, local_address in addresses.items():
        value = value.replace(f"//{compose_address}", f"//{local_address}")
    return value


def base_environment() -> dict[str, str]:
    """This machine's environment minus what a container would not inherit from it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(CONTAINER_ONLY)} | {"PYTHONUNBUFFERED": "1"}


def start_compose_redis(service: dict, directory: Path, port: int) -> Service:
    """redis-server with the compose service's arguments (`--appendonly yes`), bound to a local port."""
    command = argv(service)
    assert command[0] == "redis-server"
    directory.mkdir(parents=True, exist_ok=True)
    svc = Service(
        "redis",
        [
            redis_server_binary(),
            *command[1:],
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(directory),
            "--save",
            "",
        ],
        base_environment(),
        directory / "redis.log",
    ).start()
    wait_for(lambda: _answers(lambda: redis.Redis(port=port).ping()), 15, "redis-server did not answer", svc)
    return svc


def start_moto(directory: Path, port: int) -> Service:
    """moto's standalone S3 server in MinIO's place; it logs every request, presigned GETs included."""
    svc = Service(
        "moto",
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        base_environment(),
        directory / "moto.log",
    ).start()
    wait_for(
        lambda: _answers(lambda: httpx.get(f"http://127.0.0.1:{port}", timeout=1).status_code < 500),
        120,  # its imports take tens of seconds on 2 busy cores
        "moto server did not start",
        svc,
    )
    return svc


def _answers(check) -> bool:
    try:
        return bool(check())
    except (OSError, httpx.HTTPError, redis.RedisError):
        return False


def probe_presigned_work(url: str, join_token: str, moto_endpoint: str) -> None:
    """One work request as an extra host: the shard and snapshot URLs are presigned S3 URLs that
    serve the right bytes without any credentials; the assignment is then given back."""
    token = httpx.post(f"{url}/v1/hosts", json={"join_token": join_token, "name": "probe"}).raise_for_status()
    host = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token.json()['host_token']}"}, timeout=60)
    with host:
        deadline = time.monotonic() + 30
        while not (assignments := host.post("/v1/work", json={"free_slots": 1}).json()["assignments"]):
            assert time.monotonic() < deadline, "the probe host got no work"
            time.sleep(0.5)
        a = assignments[0]
        for ref in (a["shard"], a["snapshot"]):
            assert ref["url"].startswith(f"{moto_endpoint}/"), ref["url"]
            assert PRESIGNED.search(ref["url"]), ref["url"]
            body = httpx.get(ref["url"], timeout=30).raise_for_status().content
            assert hashlib.sha256(body).hexdigest() == ref["sha256"]
        host.post(f"/v1/assignments/{a['assignment_id']}/abandon").raise_for_status()


def server_environment(services: dict, addresses: dict[str, str], database_url: str, var_dir: Path) -> dict[str, str]:
    """The server services' compose environment with the compose network's addresses made local."""
    compose_env = environment(services["scheduler"])
    assert urlparse(compose_env["CROWDTRAIN_DATABASE_URL"]).hostname == "postgres"
    return (
        base_environment()
        | {k: localize(v, addresses) for k, v in compose_env.items()}
        | {
            "CROWDTRAIN_DATABASE_URL": database_url,  # the fixture's fresh database stands in for `postgres`
            "CROWDTRAIN_VAR_DIR": str(var_dir),
        }
    )


def create_bucket(env: dict[str, str]) -> None:
    """What `createbucket` does: the bucket of CROWDTRAIN_STORAGE_URL, made with the MinIO root credentials."""
    boto3.client(
        "s3",
        endpoint_url=env["CROWDTRAIN_S3_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    ).create_bucket(Bucket=urlparse(env["CROWDTRAIN_STORAGE_URL"]).netloc)


def start_server_services(cluster: Cluster, services: dict, env: dict[str, str], logs: Path) -> None:
    """migrate to completion first (service_completed_successfully), then the long-running services."""
    migrate = Service("migrate", crowdtrain_process(argv(services["migrate"])), env, logs / "migrate.log").start()
    assert migrate.proc.wait(120) == 0, migrate.tail()
    for name in ("scheduler", "assimilator", "transitioner"):
        command = argv(services[name])
        if name == "scheduler":
            assert command[command.index("--host") + 1] == "0.0.0.0"
            # Only the port changes: 8000 may be taken on this machine (compose publishes it the same way).
            command = replace_option(command, "--port", str(cluster.port))
        cluster.services.append(Service(name, crowdtrain_process(command), env, logs / f"{name}.log").start())
    wait_for(
        lambda: scheduler_is_live(cluster.url),
        180,
        "the scheduler did not come up",
        cluster.service("scheduler"),
    )
    # The scheduler's own healthcheck command, pointed at the local port, passes too.
    healthcheck = services["scheduler"]["healthcheck"]["test"]
    assert healthcheck[:2] == ["CMD", "python"]
    probe = [sys.executable, *(localize(a, {"127.0.0.1:8000": f"127.0.0.1:{cluster.port}"}) for a in healthcheck[2:])]
    assert subprocess.run(probe, timeout=30).returncode == 0
    # So do the parameter server's and the transitioner's, once each has written its health record.
    for name in ("assimilator", "transitioner"):
        check = crowdtrain_process(services[name]["healthcheck"]["test"][1:])
        wait_for(
            lambda check=check: subprocess.run(check, env=env, capture_output=True, timeout=60).returncode == 0,
            120,
            f"the {name}'s healthcheck did not pass",
            cluster.service(name),
        )


def client_process(services: dict, addresses: dict[str, str], cache: Path) -> list[str]:
    """The `client` service's process (image ENTRYPOINT + command) with a local server URL and cache."""
    service = services["client"]
    command = argv(service, dockerfile_entrypoint(ROOT / service["build"]["dockerfile"]))
    command = replace_option(command, "--server", localize(command[command.index("--server") + 1], addresses))
    command = replace_option(command, "--cache", str(cache))
    # Two clients share this machine's cores: one training thread each, like the other end-to-end tests.
    return crowdtrain_process([*command, "--threads", "1"])


def test_the_compose_services_train_the_example_job_as_local_processes(postgres_url: str, tmp_path: Path) -> None:
    services = load_compose(DOT_ENV)["services"]
    redis_port, moto_port, scheduler_port = free_port(), free_port(), free_port()
    addresses = {
        "redis:6379": f"127.0.0.1:{redis_port}",
        "minio:9000": f"127.0.0.1:{moto_port}",
        "scheduler:8000": f"127.0.0.1:{scheduler_port}",
    }
    env = server_environment(services, addresses, postgres_url, tmp_path / "var")
    moto_endpoint = env["CROWDTRAIN_S3_ENDPOINT_URL"]
    assert moto_endpoint == f"http://127.0.0.1:{moto_port}"
    logs = tmp_path / "logs"
    cluster = Cluster(
        var_dir=tmp_path,
        database_url=postgres_url,
        redis_url=env["CROWDTRAIN_REDIS_URL"],
        storage_url=env["CROWDTRAIN_STORAGE_URL"],
        admin_token=env["CROWDTRAIN_ADMIN_TOKEN"],
        join_token=env["CROWDTRAIN_JOIN_TOKEN"],
        port=scheduler_port,
    )
    try:
        cluster.services.append(start_compose_redis(services["redis"], tmp_path / "redis", redis_port))
        assert redis.Redis.from_url(cluster.redis_url).config_get("appendonly") == {"appendonly": "yes"}
        moto = start_moto(logs, moto_port)
        cluster.services.append(moto)
        create_bucket(env)
        start_server_services(cluster, services, env, logs)

        job_id = submit(cluster)
        probe_presigned_work(cluster.url, cluster.join_token, moto_endpoint)
        client_env = base_environment() | environment(services["client"])  # its join token
        for i in range(2):
            cluster.clients.append(
                Service(
                    f"client{i}",
                    client_process(services, addresses, tmp_path / f"cache{i}"),
                    client_env,
                    logs / f"client{i}.log",
                ).start()
            )

        st = wait_finished(cluster, job_id, timeout=420)
        assert st["status"] == "succeeded", st["status_message"]
        assert max(e["mean_accuracy"] or 0 for e in st["epochs"]) >= 0.90
        assert_exact_accounting(cluster, job_id)
        # The clients fetched shards from S3 through presigned URLs, not through the scheduler.
        presigned_gets = [
            line
            for line in moto.log_path.read_text(errors="replace").splitlines()
            if re.search(rf'"GET /[^ ]+/jobs/{job_id}/shards/', line) and PRESIGNED.search(line)
        ]
        assert len(presigned_gets) >= 3, moto.tail()  # the probe's, and at least one per client
    finally:
        cluster.stop()
