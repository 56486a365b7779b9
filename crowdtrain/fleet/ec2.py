"""The boto3 side of spot fleets: create, list and tear down the EC2 resources of a named fleet.

Thin on purpose: every request body is built by `crowdtrain.fleet.spec`; this module only sends them
and turns EC2's answers into `FleetInstance` rows. A fleet is one launch template plus one EC2
Fleet of type `maintain`, both tagged `crowdtrain:fleet=<name>` like the instances they start.
"""

import base64
from dataclasses import dataclass, field
from datetime import UTC, datetime

from crowdtrain.fleet.spec import (
    FLEET_TAG,
    SERVER_TAG,
    FleetInstance,
    FleetSpec,
    fleet_request,
    launch_template_data,
    template_name,
    user_data,
)

GONE_STATES = {"shutting-down", "terminated"}
LIVE_REQUEST_STATES = ["open", "active"]


class FleetExists(Exception):
    """A fleet of this name still has its launch template: take it down before starting it again."""


def ec2_client(region: str | None, endpoint_url: str | None):
    import boto3

    return boto3.client("ec2", region_name=region, endpoint_url=endpoint_url)


def _pages(ec2, operation: str, key: str, **kwargs) -> list[dict]:
    return [item for page in ec2.get_paginator(operation).paginate(**kwargs) for item in page[key]]


def _chunks(ids: list[str], size: int = 100) -> list[list[str]]:
    """EC2 bounds the values of one filter and the ids of one call; 100 is within every bound."""
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _tag(resource: dict, key: str) -> str | None:
    return next((t["Value"] for t in resource.get("Tags", []) if t["Key"] == key), None)


@dataclass
class Teardown:
    """What `fleet down` did; every list is empty when there was nothing left to do."""

    fleets_deleted: list[str] = field(default_factory=list)
    requests_cancelled: list[str] = field(default_factory=list)
    instances_terminated: list[FleetInstance] = field(default_factory=list)
    template_deleted: str | None = None


class Ec2Fleets:
    """The spot fleets of one AWS account and region (or one EC2-compatible endpoint)."""

    def __init__(self, ec2) -> None:
        self.ec2 = ec2

    def up(self, spec: FleetSpec) -> str:
        """Create the fleet's launch template and EC2 Fleet; returns the fleet id.
        Raises `FleetExists` if the name is taken, having requested nothing."""
        name = template_name(spec.name)
        if self._template_id(name):
            raise FleetExists(
                f"fleet {spec.name!r} exists (launch template {name}); "
                f"run `crowdtrain fleet down --name {spec.name}` first"
            )
        encoded = base64.b64encode(user_data(spec).encode()).decode()
        template = self.ec2.create_launch_template(
            LaunchTemplateName=name,
            LaunchTemplateData=launch_template_data(spec, encoded),
            TagSpecifications=[{"ResourceType": "launch-template", "Tags": [{"Key": FLEET_TAG, "Value": spec.name}]}],
        )["LaunchTemplate"]
        try:
            return self.ec2.create_fleet(**fleet_request(spec, template["LaunchTemplateId"]))["FleetId"]
        except Exception:
            # Leave no half-made fleet behind: a template without a fleet would block the next `up`.
            self.ec2.delete_launch_template(LaunchTemplateId=template["LaunchTemplateId"])
            raise

    def fleets(self, fleet: str) -> list[dict]:
        """The EC2 Fleets tagged with this name, deleted ones included (EC2 lists them for a while).
        DescribeFleets has no tag filter, hence the filtering here."""
        return [f for f in _pages(self.ec2, "describe_fleets", "Fleets") if _tag(f, FLEET_TAG) == fleet]

    def server_url(self, fleet: str) -> str | None:
        """The scheduler URL the fleet's clients were started with."""
        return next((url for f in self.fleets(fleet) if (url := _tag(f, SERVER_TAG))), None)

    def instances(self, fleet: str) -> list[FleetInstance]:
        """Every instance tagged with this fleet, oldest first, with its price cap and spot price."""
        raw = [
            i
            for r in _pages(
                self.ec2,
                "describe_instances",
                "Reservations",
                Filters=[{"Name": f"tag:{FLEET_TAG}", "Values": [fleet]}],
            )
            for i in r["Instances"]
        ]
        caps = self._price_caps(fleet)
        prices = self._spot_prices({i["InstanceType"] for i in raw})
        rows = [
            FleetInstance(
                instance_id=i["InstanceId"],
                instance_type=i["InstanceType"],
                state=i["State"]["Name"],
                lifecycle=i.get("InstanceLifecycle", "on-demand"),
                availability_zone=i.get("Placement", {}).get("AvailabilityZone"),
                launch_time=i.get("LaunchTime"),
                max_price=caps.get(i["InstanceType"]),
                spot_price=prices.get((i["InstanceType"], i.get("Placement", {}).get("AvailabilityZone"))),
            )
            for i in raw
        ]
        return sorted(rows, key=lambda r: (r.launch_time is None, r.launch_time, r.instance_id))

    def down(self, fleet: str) -> Teardown:
        """Delete the fleet's EC2 Fleets, cancel its spot requests, terminate its instances and delete
        its launch template. Idempotent: what is already gone is skipped, so a second call does nothing.

        The order matters: a live `maintain` fleet or persistent spot request would replace a
        terminated instance, so both go before the instances do.
        """
        done = Teardown()
        # Listed before as well as after: deleting a fleet already starts terminating its
        # instances, and the fleet may have launched a replacement in between.
        before = self.instances(fleet)
        live_fleets = [f["FleetId"] for f in self.fleets(fleet) if not f["FleetState"].startswith("deleted")]
        if live_fleets:
            self.ec2.delete_fleets(FleetIds=live_fleets, TerminateInstances=True)
            done.fleets_deleted = live_fleets
        after = self.instances(fleet)
        done.requests_cancelled = self._cancel_requests([i.instance_id for i in after])
        for ids in _chunks([i.instance_id for i in after if i.state not in GONE_STATES]):
            self.ec2.terminate_instances(InstanceIds=ids)
        live = {i.instance_id: i for i in before + after if i.state not in GONE_STATES}
        done.instances_terminated = list(live.values())
        template_id = self._template_id(template_name(fleet))
        if template_id:
            self.ec2.delete_launch_template(LaunchTemplateId=template_id)
            done.template_deleted = template_name(fleet)
        return done

    def _cancel_requests(self, instance_ids: list[str]) -> list[str]:
        cancelled = []
        for chunk in _chunks(instance_ids):
            live = _pages(
                self.ec2,
                "describe_spot_instance_requests",
                "SpotInstanceRequests",
                Filters=[{"Name": "instance-id", "Values": chunk}, {"Name": "state", "Values": LIVE_REQUEST_STATES}],
            )
            ids = [r["SpotInstanceRequestId"] for r in live]
            if ids:
                self.ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=ids)
            cancelled += ids
        return cancelled

    def _template_id(self, name: str) -> str | None:
        found = _pages(
            self.ec2,
            "describe_launch_templates",
            "LaunchTemplates",
            Filters=[{"Name": "launch-template-name", "Values": [name]}],
        )
        return found[0]["LaunchTemplateId"] if found else None

    def _price_caps(self, fleet: str) -> dict[str, str]:
        caps: dict[str, str] = {}
        # Live fleets last, so that their caps win over those of a deleted fleet of the same name.
        for f in sorted(self.fleets(fleet), key=lambda f: not f["FleetState"].startswith("deleted")):
            for config in f.get("LaunchTemplateConfigs", []):
                for override in config.get("Overrides", []):
                    if override.get("MaxPrice"):
                        caps[override["InstanceType"]] = override["MaxPrice"]
        return caps

    def _spot_prices(self, instance_types: set[str]) -> dict[tuple[str, str], str]:
        """The newest Linux spot price per (instance type, availability zone)."""
        if not instance_types:
            return {}
        history = _pages(
            self.ec2,
            "describe_spot_price_history",
            "SpotPriceHistory",
            InstanceTypes=sorted(instance_types),
            ProductDescriptions=["Linux/UNIX"],
            # A start time of now returns the price in effect now, not 90 days of history.
            StartTime=datetime.now(UTC),
            PaginationConfig={"MaxItems": 1000},
        )
        newest: dict[tuple[str, str], dict] = {}
        for record in history:
            key = (record["InstanceType"], record["AvailabilityZone"])
            if key not in newest or record["Timestamp"] > newest[key]["Timestamp"]:
                newest[key] = record
        return {key: record["SpotPrice"] for key, record in newest.items()}
