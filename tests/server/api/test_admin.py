"""Operator commands over the CLI against a real scheduler: join tokens and host revocation."""

import json
import subprocess
import sys

import httpx
import pytest

from crowdtrain.core.jobspec import load_job_spec
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration


def cli(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "crowdtrain",
            "admin",
            *args,
            "--server",
            cluster.url,
            "--admin-token",
            cluster.admin_token,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def register(cluster, join_token: str) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/hosts", json={"join_token": join_token, "name": "h"}, timeout=30)


def test_join_tokens_are_issued_listed_and_revoked(make_cluster, sqlite_url) -> None:
    cluster = make_cluster(sqlite_url)
    created = cli(cluster, "join-token", "create", "--label", "spot fleet A")
    assert created.returncode == 0, created.stderr
    token = json.loads(created.stdout)
    assert register(cluster, token["token"]).status_code == 201
    listed = cli(cluster, "join-token", "list")
    assert "spot fleet A" in listed.stdout and token["token"] not in listed.stdout
    assert cli(cluster, "join-token", "revoke", str(token["id"])).returncode == 0
    refused = register(cluster, token["token"])
    assert refused.status_code == 403 and "revoked" in refused.json()["detail"]
    assert register(cluster, "guess").status_code == 403
    assert cli(cluster, "join-token", "revoke", "999").returncode == 2


def test_a_join_token_issued_to_an_account_with_its_own_limit(make_cluster, sqlite_url) -> None:
    cluster = make_cluster(sqlite_url)
    args = ("--label", "alice's PCs", "--account", "alice", "--registrations-per-hour", "2")
    created = cli(cluster, "join-token", "create", *args)
    assert created.returncode == 0, created.stderr
    token = json.loads(created.stdout)
    assert (token["account"], token["registrations_per_hour"]) == ("alice", 2)
    for name in ("pc-1", "pc-2"):
        body = {"join_token": token["token"], "name": name, "account": "someone-else"}
        assert httpx.post(f"{cluster.url}/v1/hosts", json=body, timeout=30).status_code == 201
    refused = register(cluster, token["token"])
    assert refused.status_code == 429 and "registered 2 hosts in the last hour" in refused.json()["detail"]
    assert int(refused.headers["Retry-After"]) > 0
    assert "alice" in cli(cluster, "join-token", "list").stdout
    with cluster.admin() as http:
        accounts = {h["name"]: h["account"] for h in http.get("/v1/admin/hosts").json()}
    assert accounts == {"pc-1": "alice", "pc-2": "alice"}
    bad = cli(cluster, "join-token", "create", "--label", "x", "--registrations-per-hour", "0")
    assert bad.returncode != 0


def test_a_revoked_host_is_refused_and_its_work_goes_back(make_cluster, sqlite_url) -> None:
    cluster = make_cluster(sqlite_url)
    with cluster.admin() as http:
        http.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")).raise_for_status()
    reg = register(cluster, cluster.join_token).json()
    host = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {reg['host_token']}"}, timeout=30)
    work = host.post("/v1/work", json={"free_slots": 2}).json()["assignments"]
    assert len(work) == 2
    revoked = cli(cluster, "host", "revoke", str(reg["host_id"]))
    assert revoked.returncode == 0, revoked.stderr
    assert host.post("/v1/work", json={"free_slots": 1}).status_code == 401
    other = httpx.Client(
        base_url=cluster.url,
        timeout=30,
        headers={"Authorization": f"Bearer {register(cluster, cluster.join_token).json()['host_token']}"},
    )
    again = other.post("/v1/work", json={"free_slots": 4}).json()["assignments"]
    assert {a["workunit_id"] for a in work} <= {a["workunit_id"] for a in again}
    with cluster.admin() as http:
        listed = {h["id"]: h["revoked"] for h in http.get("/v1/admin/hosts").json()}
    assert listed[reg["host_id"]] is True and list(listed.values()).count(True) == 1
    assert cli(cluster, "host", "list").returncode == 0
