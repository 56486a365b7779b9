"""`crowdtrain fleet` against moto's standalone EC2 server (a real subprocess) and a real scheduler.

Every CLI call is `python -m crowdtrain fleet ...` in a subprocess whose only difference from
production is CROWDTRAIN_EC2_ENDPOINT_URL (and fake AWS credentials).
"""

import base64
import json
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from crowdtrain.cli.options import JOIN_TOKEN_ENV
from crowdtrain.fleet.spec import (
    FLEET_TAG,
    SPOT_NOTICE_URL,
    FleetInstance,
    FleetSpec,
    attach_hosts,
    fleet_request,
    user_data,
)
from crowdtrain.launch.cluster import Service, free_port, wait_for

REGION = "us-east-1"
AMI = "ami-12345678"
SERVER = "http://scheduler.example.org:8000"
TOKEN = "fleet-Join_token.42"


# --- the user-data script and the request, as pure functions ----------------------------------


def _spec(**overrides) -> FleetSpec:
    fields = {
        "name": "unit",
        "count": 2,
        "instance_types": "t3.large,c5.xlarge",
        "max_price": 0.05,
        "image_id": AMI,
        "server": SERVER,
        "join_token": TOKEN,
        "tasks": 2,
    }
    return FleetSpec(**(fields | overrides))


def exec_start(script: str) -> list[str]:
    """The client's argv from the systemd unit the script writes."""
    [line] = [ln for ln in script.splitlines() if ln.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def env_file(script: str) -> list[str]:
    """The lines the script writes, verbatim, into the service's root-only environment file."""
    lines = script.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.endswith("<<'CROWDTRAIN_ENV'"))
    end = lines.index("CROWDTRAIN_ENV", start)
    return lines[start + 1 : end]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def assert_token_only_in_the_environment(script: str) -> None:
    """The client's command line (what `ps` shows) holds no join token, not even one systemd expands
    from the environment file: the client reads it from the variable the file sets."""
    argv = exec_start(script)
    assert "--join-token" not in argv and "--join-token-file" not in argv
    assert not any("JOIN_TOKEN" in arg or TOKEN in arg for arg in argv)
    assert env_file(script) == [f"{JOIN_TOKEN_ENV}={TOKEN}"]


def test_user_data_is_valid_bash(tmp_path: Path) -> None:
    script = tmp_path / "user-data.sh"
    script.write_text(user_data(_spec()))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_user_data_runs_the_client_with_the_token_from_a_root_only_file() -> None:
    script = user_data(_spec())
    argv = exec_start(script)
    assert argv[:2] == ["/opt/crowdtrain/bin/crowdtrain", "client"]
    assert option(argv, "--server") == SERVER
    assert option(argv, "--tasks") == "2"
    assert option(argv, "--spot-notice-url") == SPOT_NOTICE_URL
    # systemd fills this in from the environment file; the token is not in the (world-readable) unit.
    assert option(argv, "--name") == "${INSTANCE_ID}"
    assert_token_only_in_the_environment(script)
    assert script.count(TOKEN) == 1
    assert "set -x" not in script.replace("Never `set -x`", "")
    assert "Restart=always" in script


def test_client_package_reaches_pip_verbatim() -> None:
    """A requirement with shell metacharacters is one literal word, never a command."""
    package = "crowdtrain[client] @ git+https://example.org/o/crowdtrain@v1 ; echo 'pwned' $(id)"
    [assignment] = [
        ln for ln in user_data(_spec(client_package=package)).splitlines() if ln.startswith("CLIENT_PACKAGE=")
    ]
    result = subprocess.run(
        ["bash", "-c", f'{assignment}\nprintf %s "$CLIENT_PACKAGE"'], capture_output=True, text=True
    )
    assert result.stdout == package


def test_only_the_token_file_is_written_under_umask_077() -> None:
    """The venv and the unit must stay readable to the service's (dynamic) user."""
    lines = user_data(_spec()).splitlines()
    [umask] = [i for i, ln in enumerate(lines) if ln.strip().startswith("umask")]
    assert lines[umask] == "umask 077" and lines[umask - 1] == "("
    assert lines[umask + 1].startswith("cat > /etc/crowdtrain/client.env")
    assert lines.index(")", umask) < next(i for i, ln in enumerate(lines) if "crowdtrain-client.service <<" in ln)


def test_user_data_reads_the_instance_id_with_imdsv2() -> None:
    script = user_data(_spec())
    put = script.index('-X PUT "http://169.254.169.254/latest/api/token"')
    get = script.index('-H "X-aws-ec2-metadata-token: $IMDS_TOKEN"')
    assert put < get < script.index('echo "INSTANCE_ID=$INSTANCE_ID" >> /etc/crowdtrain/client.env')


def test_request_has_one_override_per_type_and_subnet() -> None:
    spec = _spec(subnet_ids="subnet-0123456789abcdef0,subnet-0123456789abcdef1", max_price=0.0512345)
    overrides = fleet_request(spec, "lt-1")["LaunchTemplateConfigs"][0]["Overrides"]
    assert [(o["InstanceType"], o["SubnetId"], o["MaxPrice"]) for o in overrides] == [
        ("t3.large", "subnet-0123456789abcdef0", "0.051234"),
        ("t3.large", "subnet-0123456789abcdef1", "0.051234"),
        ("c5.xlarge", "subnet-0123456789abcdef0", "0.051234"),
        ("c5.xlarge", "subnet-0123456789abcdef1", "0.051234"),
    ]


def test_instances_take_the_newest_unrevoked_host_of_their_name() -> None:
    instances = [
        FleetInstance(instance_id=i, instance_type="t3.large", state="running", lifecycle="spot")
        for i in ("i-a", "i-b")
    ]
    host = {"last_seen": "2026-01-01T00:00:00Z", "results_valid": 0}
    hosts = [
        {"id": 1, "name": "i-a", "revoked": False, **host},
        {"id": 2, "name": "i-a", "revoked": False, **host},
        {"id": 3, "name": "i-a", "revoked": True, **host},
        {"id": 4, "name": "laptop", "revoked": False, **host},
    ]
    assert [i.host.id if i.host else None for i in attach_hosts(instances, hosts)] == [2, None]


# --- the CLI against moto's EC2 server --------------------------------------------------------


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    svc = Service("moto", [sys.executable, "-m", "moto.server", "-p", str(port)], dict(os.environ), log).start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/moto-api/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 60, "moto's server did not come up", svc)
        yield url
    finally:
        svc.stop()


@pytest.fixture
def ec2(moto_url: str):
    return boto3.client(
        "ec2", endpoint_url=moto_url, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing"
    )


@pytest.fixture
def fleet_cli(moto_url: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION,
            "AWS_MAX_ATTEMPTS": "1",
            "CROWDTRAIN_EC2_ENDPOINT_URL": moto_url,
        }
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "crowdtrain", "fleet", *args], env=env, capture_output=True, text=True, timeout=120
        )

    return run


def up_args(name: str, server: str = SERVER, **changes: str) -> list[str]:
    opts = {
        "--name": name,
        "--count": "3",
        "--instance-types": "t3.large,c5.xlarge",
        "--max-price": "0.05",
        "--image-id": AMI,
        "--server": server,
        "--join-token": TOKEN,
        "--tasks": "2",
        # moto launches only the cheapest type otherwise; diversified shows every type launched.
        "--allocation-strategy": "diversified",
    } | changes
    return ["up", *[part for pair in opts.items() for part in pair]]


def fleet_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def tagged_fleets(ec2, name: str) -> list[dict]:
    return [f for f in ec2.describe_fleets()["Fleets"] if {"Key": FLEET_TAG, "Value": name} in f.get("Tags", [])]


def tagged_instances(ec2, name: str) -> list[dict]:
    reservations = ec2.describe_instances(Filters=[{"Name": f"tag:{FLEET_TAG}", "Values": [name]}])["Reservations"]
    return [i for r in reservations for i in r["Instances"]]


def test_up_requests_the_asked_types_price_and_user_data(ec2, fleet_cli) -> None:
    name = fleet_name()
    result = fleet_cli(*up_args(name))
    assert result.returncode == 0, result.stderr

    [fleet] = tagged_fleets(ec2, name)
    assert fleet["Type"] == "maintain"
    assert fleet["TargetCapacitySpecification"] == {
        "TotalTargetCapacity": 3,
        "SpotTargetCapacity": 3,
        "OnDemandTargetCapacity": 0,
        "DefaultTargetCapacityType": "spot",
    }
    [config] = fleet["LaunchTemplateConfigs"]
    assert config["Overrides"] == [
        {"InstanceType": "t3.large", "MaxPrice": "0.05"},
        {"InstanceType": "c5.xlarge", "MaxPrice": "0.05"},
    ]

    template_id = config["LaunchTemplateSpecification"]["LaunchTemplateId"]
    [version] = ec2.describe_launch_template_versions(LaunchTemplateId=template_id)["LaunchTemplateVersions"]
    script = base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()
    argv = exec_start(script)
    assert option(argv, "--server") == SERVER
    assert_token_only_in_the_environment(script)
    assert option(argv, "--name") == "${INSTANCE_ID}"
    assert option(argv, "--spot-notice-url") == "http://169.254.169.254/latest/meta-data/spot/instance-action"
    assert option(argv, "--tasks") == "2"

    instances = tagged_instances(ec2, name)
    assert len(instances) == 3
    assert {i["InstanceType"] for i in instances} == {"t3.large", "c5.xlarge"}
    assert {i["InstanceLifecycle"] for i in instances} == {"spot"}
    for i in instances:
        assert {"Key": FLEET_TAG, "Value": name} in i["Tags"]
        booted_with = ec2.describe_instance_attribute(InstanceId=i["InstanceId"], Attribute="userData")
        assert base64.b64decode(booted_with["UserData"]["Value"]).decode() == script
    fleet_cli("down", "--name", name)


def test_up_refuses_a_name_in_use(ec2, fleet_cli) -> None:
    name = fleet_name()
    assert fleet_cli(*up_args(name)).returncode == 0
    again = fleet_cli(*up_args(name))
    assert again.returncode == 2 and "fleet down" in again.stderr
    assert len(tagged_fleets(ec2, name)) == 1
    fleet_cli("down", "--name", name)


def test_status_shows_the_host_each_instance_registered_as(ec2, fleet_cli, make_cluster) -> None:
    cluster = make_cluster()
    name = fleet_name()
    assert fleet_cli(*up_args(name, server=cluster.url, **{"--count": "2"})).returncode == 0
    registered, unregistered = sorted(i["InstanceId"] for i in tagged_instances(ec2, name))
    # What the client on `registered` does at boot: register under its instance id.
    resp = httpx.post(f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": registered})
    assert resp.status_code == 201, resp.text

    # No --server: the fleet remembers the scheduler it was started with.
    result = fleet_cli("status", "--name", name, "--admin-token", cluster.admin_token, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["server"] == cluster.url and status["hosts_error"] is None
    assert [r["state"] for r in status["requests"]] == ["active"]
    by_id = {i["instance_id"]: i for i in status["instances"]}
    assert set(by_id) == {registered, unregistered}
    assert by_id[registered]["host"]["id"] == resp.json()["host_id"]
    assert by_id[registered]["host"]["results_valid"] == 0 and by_id[registered]["host"]["last_seen"]
    assert by_id[unregistered]["host"] is None
    assert all(
        i["state"] == "running" and i["lifecycle"] == "spot" and i["max_price"] == "0.05" for i in status["instances"]
    )

    table = fleet_cli("status", "--name", name, "--admin-token", cluster.admin_token)
    assert table.returncode == 0 and "running" in table.stdout
    fleet_cli("down", "--name", name)


def test_status_without_the_scheduler_still_lists_the_instances(ec2, fleet_cli) -> None:
    name = fleet_name()
    assert fleet_cli(*up_args(name, **{"--count": "2"})).returncode == 0
    nobody = f"http://127.0.0.1:{free_port()}"
    result = fleet_cli("status", "--name", name, "--server", nobody, "--admin-token", "t" * 32, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert "unreachable" in status["hosts_error"]
    without_token = json.loads(fleet_cli("status", "--name", name, "--server", nobody, "--json").stdout)
    assert "no admin token" in without_token["hosts_error"] and len(without_token["instances"]) == 2
    assert {i["instance_id"] for i in status["instances"]} == {i["InstanceId"] for i in tagged_instances(ec2, name)}
    assert [i["host"] for i in status["instances"]] == [None, None]
    fleet_cli("down", "--name", name)


def test_unreachable_ec2_exits_1_with_the_reason(fleet_cli) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    for args in (up_args(fleet_name()), ["status", "--name", "x"], ["down", "--name", "x"]):
        result = fleet_cli(*args, "--endpoint-url", nowhere)
        assert result.returncode == 1, result.stderr
        assert (
            result.stderr.startswith("EC2: Could not connect to the endpoint URL") and "Traceback" not in result.stderr
        )


def test_down_terminates_instances_and_cancels_requests_once(ec2, fleet_cli) -> None:
    name = fleet_name()
    assert fleet_cli(*up_args(name, **{"--count": "2"})).returncode == 0
    ids = {i["InstanceId"] for i in tagged_instances(ec2, name)}

    down = fleet_cli("down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert {ln.split()[1] for ln in down.stdout.splitlines() if ln.startswith("terminated ")} == ids
    assert {i["State"]["Name"] for i in tagged_instances(ec2, name)} == {"terminated"}
    assert all(f["FleetState"].startswith("deleted") for f in tagged_fleets(ec2, name))
    live = ec2.describe_spot_instance_requests(
        Filters=[{"Name": "instance-id", "Values": sorted(ids)}, {"Name": "state", "Values": ["open", "active"]}]
    )
    assert live["SpotInstanceRequests"] == []
    assert (
        ec2.describe_launch_templates(
            Filters=[{"Name": "launch-template-name", "Values": [f"crowdtrain-fleet-{name}"]}]
        )["LaunchTemplates"]
        == []
    )

    again = fleet_cli("down", "--name", name)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"fleet {name}: nothing left to take down"


def _ec2_footprint(ec2) -> tuple[int, int, int, int]:
    return (
        len(ec2.describe_fleets()["Fleets"]),
        len(ec2.describe_launch_templates()["LaunchTemplates"]),
        len(ec2.describe_spot_instance_requests()["SpotInstanceRequests"]),
        sum(len(r["Instances"]) for r in ec2.describe_instances()["Reservations"]),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--count": "0"}, "invalid --count"),
        ({"--instance-types": "t3.large,c5xlarge"}, "invalid --instance-types"),
        ({"--max-price": "-0.05"}, "invalid --max-price"),
        ({"--server": "scheduler:8000"}, "invalid --server"),
        ({"--server": "http://scheduler:8000/%n"}, "invalid --server"),
        ({"--join-token": "has space"}, "invalid --join-token"),
    ],
)
def test_bad_input_exits_2_and_requests_nothing(ec2, fleet_cli, change, message) -> None:
    before = _ec2_footprint(ec2)
    result = fleet_cli(*up_args(fleet_name(), **change))
    assert result.returncode == 2
    assert message in result.stderr
    assert _ec2_footprint(ec2) == before
