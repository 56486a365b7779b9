"""Spot fleets: EC2 spot instances that each run the volunteer client, attached to one project.

The pure part says what a fleet is: the validated request (`FleetSpec`), the cloud-init script
every instance boots with (`user_data`), the EC2 launch template and EC2 Fleet request built from
them, and the join of the fleet's instances with the scheduler's hosts (`attach_hosts`). The boto3
calls live in `crowdtrain.fleet.ec2`.

A fleet is found again by its name alone: the launch template, the EC2 Fleet and every instance
carry the tag `crowdtrain:fleet=<name>`.
"""

import math
import re
import shlex
from datetime import datetime
from decimal import ROUND_DOWN, Decimal
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from crowdtrain.core.settings import CLIENT_JOIN_TOKEN_ENV

FLEET_TAG = "crowdtrain:fleet"
SERVER_TAG = "crowdtrain:server"
IMDS_URL = "http://169.254.169.254/latest"
SPOT_NOTICE_URL = f"{IMDS_URL}/meta-data/spot/instance-action"
CLIENT_VENV = "/opt/crowdtrain"
CLIENT_ENV_FILE = "/etc/crowdtrain/client.env"
STATE_DIR = "/var/lib/crowdtrain"
PRICE_STEP = "0.000001"  # USD/h: the precision of EC2 spot prices

# A family with a generation digit, then a size: t3.large, c5.xlarge, m7i-flex.2xlarge, u-6tb1.metal.
INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*[0-9][a-z0-9-]*\.[a-z0-9]+$")
# Characters of `secrets.token_urlsafe` tokens and of usual operator-chosen ones. Anything else is
# refused rather than quoted, so the token can sit unquoted in a systemd EnvironmentFile.
JOIN_TOKEN = re.compile(r"^[A-Za-z0-9._~+/=-]{1,500}$")
# No '%' or '$': in a systemd ExecStart line they are specifiers and expansions.
SERVER_URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/-]*)?$")

AllocationStrategy = Literal["price-capacity-optimized", "capacity-optimized", "lowest-price", "diversified"]


def _comma_list(value: object) -> object:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


class FleetSpec(BaseModel):
    """What `crowdtrain fleet up` asks EC2 for; invalid input never reaches EC2."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="Fleet name: tags every resource, finds the fleet again",
    )
    count: int = Field(..., ge=1, le=1000, description="Spot instances to keep running")
    instance_types: list[str] = Field(..., min_length=1, max_length=50)
    max_price: float | None = Field(None, gt=0, description="USD per instance-hour; None caps at on-demand")
    image_id: str = Field(..., pattern=r"^ami-[0-9a-f]{8,17}$")
    server: str = Field(..., max_length=500, description="Scheduler URL the clients attach to")
    join_token: str = Field(..., repr=False)
    tasks: int = Field(1, ge=1, le=64)
    client_package: str = Field(
        "crowdtrain[client]",
        min_length=1,
        max_length=500,
        pattern=r"^[^\r\n]+$",
        description="pip requirement installed on boot (one shell-quoted argument to pip)",
    )
    key_name: str | None = Field(None, min_length=1, max_length=255)
    subnet_ids: list[str] = Field(default_factory=list, max_length=20)
    security_group_ids: list[str] = Field(default_factory=list, max_length=5)
    allocation_strategy: AllocationStrategy = "price-capacity-optimized"

    _split = field_validator("instance_types", "subnet_ids", "security_group_ids", mode="before")(_comma_list)

    @field_validator("instance_types")
    @classmethod
    def _instance_types(cls, types: list[str]) -> list[str]:
        bad = [t for t in types if not INSTANCE_TYPE.match(t)]
        if bad:
            raise ValueError(f"not an EC2 instance type (like c5.xlarge): {', '.join(bad)}")
        return _unique(types)

    @field_validator("max_price")
    @classmethod
    def _finite_price(cls, price: float | None) -> float | None:
        if price is not None and not (math.isfinite(price) and price >= float(PRICE_STEP)):
            raise ValueError(f"must be a finite number of USD per hour, at least {PRICE_STEP}")
        return price

    @field_validator("server")
    @classmethod
    def _server_url(cls, url: str) -> str:
        if not SERVER_URL.match(url):
            raise ValueError("must be an http(s) URL such as https://scheduler.example.org:8000")
        return url.rstrip("/")

    @field_validator("join_token")
    @classmethod
    def _join_token(cls, token: str) -> str:
        if not JOIN_TOKEN.match(token):
            raise ValueError("must be 1-500 characters of A-Z a-z 0-9 . _ ~ + / = -")
        return token

    @field_validator("subnet_ids")
    @classmethod
    def _subnets(cls, ids: list[str]) -> list[str]:
        return _aws_ids(ids, "subnet")

    @field_validator("security_group_ids")
    @classmethod
    def _security_groups(cls, ids: list[str]) -> list[str]:
        return _aws_ids(ids, "sg")

    @property
    def max_price_text(self) -> str | None:
        """The price as EC2 takes it: a decimal string of at most 6 decimals (EC2's precision),
        rounded down, because it is a cap the operator must not be charged above."""
        if self.max_price is None:
            return None
        text = str(Decimal(repr(self.max_price)).quantize(Decimal(PRICE_STEP), rounding=ROUND_DOWN))
        return text.rstrip("0").rstrip(".")


def _aws_ids(ids: list[str], prefix: str) -> list[str]:
    bad = [i for i in ids if not re.match(rf"^{prefix}-[0-9a-f]{{8,17}}$", i)]
    if bad:
        raise ValueError(f"not a {prefix}-… id: {', '.join(bad)}")
    return _unique(ids)


def template_name(fleet: str) -> str:
    return f"crowdtrain-fleet-{fleet}"


def client_command(spec: FleetSpec) -> list[str]:
    """The client's command line on every instance. It holds no token: the client reads its join token
    from CLIENT_JOIN_TOKEN_ENV, which systemd sets from the root-only environment file (an environment
    is readable by the process's user and root only, an argument by everyone), so neither `ps`, the unit
    file nor the journal shows it. `${INSTANCE_ID}` is filled in by systemd from that file."""
    return [
        f"{CLIENT_VENV}/bin/crowdtrain",
        "client",
        "--server",
        spec.server,
        "--name",
        "${INSTANCE_ID}",
        "--tasks",
        str(spec.tasks),
        "--spot-notice-url",
        SPOT_NOTICE_URL,
        "--cache",
        STATE_DIR,
    ]


_BOOTSTRAP = r"""#!/bin/bash
# crowdtrain spot-fleet bootstrap (cloud-init user-data): install the client, run it as a service.
# Never `set -x` here and never echo the environment file: cloud-init logs this script's output.
set -euo pipefail

CLIENT_PACKAGE=__CLIENT_PACKAGE__

if command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    # At first boot unattended-upgrades may hold the dpkg lock for a while: wait for it.
    apt-get -o DPkg::Lock::Timeout=600 update -q
    apt-get -o DPkg::Lock::Timeout=600 install -y -q python3 python3-venv curl
elif command -v dnf >/dev/null; then
    # Amazon Linux 2023's python3 is 3.9; crowdtrain needs 3.11 or newer.
    dnf install -y -q python3.11 python3.11-pip || dnf install -y -q python3 python3-pip
fi
PYTHON=""
for candidate in python3.13 python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        PYTHON="$candidate"
        break
    fi
done
if [ -z "$PYTHON" ]; then
    echo "crowdtrain: no Python 3.11+ on this image" >&2
    exit 1
fi
"$PYTHON" -m venv __CLIENT_VENV__
__CLIENT_VENV__/bin/pip install --quiet --upgrade pip
__CLIENT_VENV__/bin/pip install --quiet "$CLIENT_PACKAGE"

# IMDSv2: a session token first (PUT), then the instance id; works whether or not IMDSv1 is off.
IMDS_TOKEN=$(curl -fsS --retry 10 --retry-connrefused -X PUT "__IMDS_URL__/api/token" \
    -H "X-aws-ec2-metadata-token-ttl-seconds: 300")
INSTANCE_ID=$(curl -fsS --retry 10 --retry-connrefused -H "X-aws-ec2-metadata-token: $IMDS_TOKEN" \
    "__IMDS_URL__/meta-data/instance-id")

# Root-only from its first byte (umask in a subshell: the venv above must stay readable to the service).
mkdir -p "$(dirname __CLIENT_ENV_FILE__)"
(
umask 077
cat > __CLIENT_ENV_FILE__ <<'CROWDTRAIN_ENV'
__CLIENT_JOIN_TOKEN_ENV__=__JOIN_TOKEN__
CROWDTRAIN_ENV
echo "INSTANCE_ID=$INSTANCE_ID" >> __CLIENT_ENV_FILE__
)

cat > /etc/systemd/system/crowdtrain-client.service <<'CROWDTRAIN_UNIT'
[Unit]
Description=crowdtrain volunteer client (spot fleet)
Wants=network-online.target
After=network-online.target

[Service]
EnvironmentFile=__CLIENT_ENV_FILE__
ExecStart=__EXEC_START__
Restart=always
RestartSec=5
DynamicUser=yes
StateDirectory=crowdtrain
Environment=HOME=__STATE_DIR__ PYTHONUNBUFFERED=1
# SIGTERM makes the client abandon its running work, so the scheduler re-dispatches it at once.
KillSignal=SIGTERM
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target
CROWDTRAIN_UNIT
systemctl daemon-reload
systemctl enable --now crowdtrain-client.service
echo "crowdtrain: client started as $INSTANCE_ID"
"""


def user_data(spec: FleetSpec) -> str:
    """The cloud-init shell script every instance of the fleet boots with.

    The join token appears once, in a quoted heredoc that writes a root-only environment file;
    the script prints nothing that contains it. Values are validated by `FleetSpec`, so they need
    no quoting inside the heredocs; the pip requirement is shell-quoted all the same.
    """
    fields = {
        "__CLIENT_PACKAGE__": shlex.quote(spec.client_package),
        "__CLIENT_VENV__": CLIENT_VENV,
        "__IMDS_URL__": IMDS_URL,
        "__CLIENT_ENV_FILE__": CLIENT_ENV_FILE,
        "__CLIENT_JOIN_TOKEN_ENV__": CLIENT_JOIN_TOKEN_ENV,
        "__JOIN_TOKEN__": spec.join_token,
        "__EXEC_START__": " ".join(client_command(spec)),
        "__STATE_DIR__": STATE_DIR,
    }
    script = _BOOTSTRAP
    for key, value in fields.items():
        script = script.replace(key, value)
    return script


def _tags(spec: FleetSpec, resource_type: str) -> dict:
    return {
        "ResourceType": resource_type,
        "Tags": [
            {"Key": FLEET_TAG, "Value": spec.name},
            {"Key": SERVER_TAG, "Value": spec.server},
            {"Key": "Name", "Value": f"crowdtrain-{spec.name}"},
        ],
    }


def launch_template_data(spec: FleetSpec, user_data_b64: str) -> dict:
    """EC2 launch template data: what every instance of the fleet looks like. Instance tags live
    here because EC2 Fleets of type `maintain` cannot tag instances themselves."""
    data: dict = {
        "ImageId": spec.image_id,
        "UserData": user_data_b64,
        "TagSpecifications": [_tags(spec, "instance"), _tags(spec, "volume")],
    }
    if spec.key_name:
        data["KeyName"] = spec.key_name
    if spec.security_group_ids:
        data["SecurityGroupIds"] = spec.security_group_ids
    return data


def fleet_request(spec: FleetSpec, template_id: str) -> dict:
    """Keyword arguments of `ec2.create_fleet`: a `maintain` EC2 Fleet, all spot, one override per
    (instance type, subnet). `maintain` makes EC2 replace preempted instances by itself."""
    overrides = []
    for instance_type in spec.instance_types:
        subnets: list[str | None] = [*spec.subnet_ids] or [None]  # None: an override without SubnetId
        for subnet in subnets:
            override: dict = {"InstanceType": instance_type}
            if subnet:
                override["SubnetId"] = subnet
            if spec.max_price_text:
                override["MaxPrice"] = spec.max_price_text
            overrides.append(override)
    return {
        "Type": "maintain",
        "SpotOptions": {"AllocationStrategy": spec.allocation_strategy, "InstanceInterruptionBehavior": "terminate"},
        "TargetCapacitySpecification": {
            "TotalTargetCapacity": spec.count,
            "SpotTargetCapacity": spec.count,
            "OnDemandTargetCapacity": 0,
            "DefaultTargetCapacityType": "spot",
        },
        "LaunchTemplateConfigs": [
            {
                "LaunchTemplateSpecification": {"LaunchTemplateId": template_id, "Version": "$Latest"},
                "Overrides": overrides,
            }
        ],
        "ReplaceUnhealthyInstances": False,
        "TagSpecifications": [_tags(spec, "fleet")],
    }


class FleetHost(BaseModel):
    """The scheduler's view of one instance: the host whose name is the instance id."""

    id: int
    last_seen: datetime
    results_valid: int
    revoked: bool


class FleetInstance(BaseModel):
    instance_id: str
    instance_type: str
    state: str
    lifecycle: str = Field(..., description="spot or on-demand")
    availability_zone: str | None = None
    launch_time: datetime | None = None
    max_price: str | None = Field(None, description="The fleet's cap for this type; None = on-demand price")
    spot_price: str | None = Field(None, description="Current spot price of this type in this zone")
    host: FleetHost | None = None


def attach_hosts(instances: list[FleetInstance], hosts: list[dict]) -> list[FleetInstance]:
    """Each instance with the host registered under its instance id (the client's `--name`).

    A client that lost its cache registers again under the same name; the newest registration
    that is not revoked is the one at work, so it wins.
    """
    by_name: dict[str, FleetHost] = {}
    for h in sorted(hosts, key=lambda h: (not h["revoked"], h["id"])):
        by_name[h["name"]] = FleetHost.model_validate(h)
    return [i.model_copy(update={"host": by_name.get(i.instance_id)}) for i in instances]
