"""`crowdtrain fleet`: spot fleets of EC2 instances that each run the client, and the hosts they became."""

import json
from typing import Annotated

import httpx
import typer
from pydantic import ValidationError

from crowdtrain.cli.adminapi import TokenOpt, admin_client, print_rows
from crowdtrain.cli.errors import UserError
from crowdtrain.cli.options import (
    HELP_LAYOUT,
    SERVER_ENV,
    JoinTokenFileOpt,
    JoinTokenOpt,
    resolve_join_token,
)
from crowdtrain.core.settings import get_settings
from crowdtrain.fleet.ec2 import Ec2Fleets, FleetExists, ec2_client
from crowdtrain.fleet.spec import FleetSpec, attach_hosts

app = typer.Typer(
    name="fleet",
    help="Spot fleets: EC2 spot instances that each run the client for this project.",
    no_args_is_help=True,
    add_completion=False,
    **HELP_LAYOUT,
)

FleetNameOpt = Annotated[str, typer.Option("--name", help="Fleet name; tags every instance crowdtrain:fleet=NAME")]
RegionOpt = Annotated[str | None, typer.Option(help="AWS region (default: the AWS configuration)")]
Ec2EndpointOpt = Annotated[
    str | None, typer.Option(help="EC2 endpoint (default: CROWDTRAIN_EC2_ENDPOINT_URL, else AWS)")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document for scripts (default: a table)")]
# FleetSpec fields whose CLI option is named differently.
_FLEET_OPTIONS = {
    "instance_types": "--instance-types",
    "subnet_ids": "--subnet-id",
    "security_group_ids": "--security-group-id",
}


def _fleets(region: str | None, endpoint_url: str | None) -> Ec2Fleets:
    return Ec2Fleets(ec2_client(region, endpoint_url or get_settings().ec2_endpoint_url))


def _ec2(call):
    """Run `call()`; an EC2 refusal or missing credentials/region ends the command with its message."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        typer.echo("crowdtrain fleet needs boto3: pip install 'crowdtrain[fleet]'", err=True)
        raise typer.Exit(1) from None

    try:
        return call()
    except (BotoCoreError, ClientError) as exc:
        typer.echo(f"EC2: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command("up")
def fleet_up(
    name: FleetNameOpt,
    count: Annotated[int, typer.Option(help="Spot instances to keep running (>= 1)")],
    instance_types: Annotated[str, typer.Option(help="Comma list, e.g. t3.large,c5.xlarge")],
    image_id: Annotated[str, typer.Option(help="AMI with systemd and Python 3.11+ (Ubuntu 24.04, Amazon Linux 2023)")],
    server: Annotated[
        str, typer.Option(envvar=SERVER_ENV, show_envvar=True, help="Scheduler URL the clients attach to")
    ],
    join_token: JoinTokenOpt = None,
    join_token_file: JoinTokenFileOpt = None,
    max_price: Annotated[float | None, typer.Option(help="USD per instance-hour (default: on-demand price)")] = None,
    tasks: Annotated[int, typer.Option(help="Assignments each client runs at once")] = 1,
    client_package: Annotated[str, typer.Option(help="pip requirement installed on every instance")] = (
        "crowdtrain[client]"
    ),
    key_name: Annotated[
        str | None, typer.Option(help="EC2 key pair for SSH (default: none)", show_default=False)
    ] = None,
    subnet_id: Annotated[
        str | None,
        typer.Option(
            help="Subnet(s), comma list; several zones find more capacity (default: the default VPC's)",
            show_default=False,
        ),
    ] = None,
    security_group_id: Annotated[
        str | None,
        typer.Option(help="Security group(s), comma list (default: the VPC's default group)", show_default=False),
    ] = None,
    allocation_strategy: Annotated[
        str, typer.Option(help="price-capacity-optimized, capacity-optimized, lowest-price or diversified")
    ] = "price-capacity-optimized",
    region: RegionOpt = None,
    endpoint_url: Ec2EndpointOpt = None,
) -> None:
    """Request COUNT spot instances; each installs the client and attaches it to SERVER.
    EC2 keeps COUNT running, replacing preempted ones, until `fleet down`."""
    join_token = resolve_join_token(join_token, join_token_file)
    # The options are raw text (comma lists, a strategy's name) that FleetSpec's validators parse.
    try:
        spec = FleetSpec.model_validate(
            {
                "name": name,
                "count": count,
                "instance_types": instance_types,
                "max_price": max_price,
                "image_id": image_id,
                "server": server,
                "join_token": join_token,
                "tasks": tasks,
                "client_package": client_package,
                "key_name": key_name,
                "subnet_ids": subnet_id or [],
                "security_group_ids": security_group_id or [],
                "allocation_strategy": allocation_strategy,
            }
        )
    except ValidationError as exc:
        for error in exc.errors():
            option = _FLEET_OPTIONS.get(str(error["loc"][0]), "--" + str(error["loc"][0]).replace("_", "-"))
            typer.echo(f"invalid {option}: {error['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(2) from None
    try:
        fleet_id = _ec2(lambda: _fleets(region, endpoint_url).up(spec))
    except FleetExists as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    price = f"{spec.max_price_text} USD/h" if spec.max_price_text else "the on-demand price"
    typer.echo(
        f"fleet {spec.name}: requested {spec.count} spot instance(s) of {', '.join(spec.instance_types)} "
        f"at up to {price} ({fleet_id}); clients attach to {spec.server}"
    )


def _fleet_hosts(server: str | None, admin_token: str | None) -> tuple[list[dict], str | None]:
    """The scheduler's hosts, or why they could not be read: status still shows the instances."""
    if not server:
        return [], "no scheduler URL: pass --server"
    try:
        with admin_client(server, admin_token) as http:
            resp = http.get("/v1/admin/hosts")
    except httpx.HTTPError as exc:
        return [], f"{server} unreachable: {exc}"
    except UserError as exc:  # no admin token: the instances are listed all the same
        return [], str(exc)
    if resp.status_code >= 400:
        return [], f"{server} answered {resp.status_code}: {resp.text[:200]}"
    return resp.json(), None


def _minute(t) -> str:
    return t.strftime("%Y-%m-%d %H:%M") if t else "-"


@app.command("status")
def fleet_status(
    name: FleetNameOpt,
    server: Annotated[
        str | None,
        typer.Option(
            envvar=SERVER_ENV,
            show_envvar=True,
            show_default=False,
            help="Scheduler URL (default: the one the fleet was started with)",
        ),
    ] = None,
    admin_token: TokenOpt = None,
    as_json: JsonOpt = False,
    region: RegionOpt = None,
    endpoint_url: Ec2EndpointOpt = None,
) -> None:
    """The fleet's instances, each with the host its client registered as on the scheduler."""
    fleets = _ec2(lambda: _fleets(region, endpoint_url))
    requests = [
        {
            "fleet_id": f["FleetId"],
            "state": f["FleetState"],
            "target_capacity": f["TargetCapacitySpecification"]["TotalTargetCapacity"],
            "fulfilled_capacity": f.get("FulfilledCapacity"),
        }
        for f in _ec2(lambda: fleets.fleets(name))
    ]
    instances = _ec2(lambda: fleets.instances(name))
    server = server or _ec2(lambda: fleets.server_url(name))
    hosts, hosts_error = _fleet_hosts(server, admin_token)
    rows = attach_hosts(instances, hosts)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "fleet": name,
                    "server": server,
                    "requests": requests,
                    "hosts_error": hosts_error,
                    "instances": [r.model_dump(mode="json") for r in rows],
                }
            )
        )
        return
    if hosts_error:
        typer.echo(f"hosts unknown: {hosts_error}", err=True)
    if not requests and not rows:
        typer.echo(f"fleet {name}: no such fleet here (check --region)")
        return
    for r in requests:
        typer.echo(f"{r['fleet_id']}: {r['state']}, {r['fulfilled_capacity']}/{r['target_capacity']} running")
    print_rows(
        [
            {
                "instance": r.instance_id,
                "type": r.instance_type,
                "state": r.state,
                "lifecycle": r.lifecycle,
                "zone": r.availability_zone,
                "spot price": r.spot_price,
                "max price": r.max_price or "on-demand",
                "launched": _minute(r.launch_time),
                "host": r.host.id if r.host else "-",
                "last seen": _minute(r.host.last_seen) if r.host else "-",
                "results valid": r.host.results_valid if r.host else "-",
            }
            for r in rows
        ],
        [
            "instance",
            "type",
            "state",
            "lifecycle",
            "zone",
            "spot price",
            "max price",
            "launched",
            "host",
            "last seen",
            "results valid",
        ],
    )


@app.command("down")
def fleet_down(
    name: FleetNameOpt, as_json: JsonOpt = False, region: RegionOpt = None, endpoint_url: Ec2EndpointOpt = None
) -> None:
    """Cancel the fleet's requests and terminate its instances. Safe to run again."""
    done = _ec2(lambda: _fleets(region, endpoint_url).down(name))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "fleet": name,
                    "fleets_deleted": done.fleets_deleted,
                    "requests_cancelled": done.requests_cancelled,
                    "instances_terminated": [i.model_dump(mode="json") for i in done.instances_terminated],
                    "template_deleted": done.template_deleted,
                }
            )
        )
        return
    for fleet_id in done.fleets_deleted:
        typer.echo(f"deleted EC2 fleet {fleet_id}")
    for request_id in done.requests_cancelled:
        typer.echo(f"cancelled spot request {request_id}")
    for i in done.instances_terminated:
        typer.echo(f"terminated {i.instance_id} ({i.instance_type}, was {i.state})")
    if done.template_deleted:
        typer.echo(f"deleted launch template {done.template_deleted}")
    if not (done.fleets_deleted or done.requests_cancelled or done.instances_terminated or done.template_deleted):
        typer.echo(f"fleet {name}: nothing left to take down")
