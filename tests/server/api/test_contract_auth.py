"""The API's contract for callers it does not admit and bodies it cannot read: every guarded route
answers 401 (with a Bearer challenge) to a missing or wrong token, every body error is a 422 that
names the field, and none of these refusals changes anything stored."""

import pytest

from crowdtrain.core.settings import MIN_TOKEN_BITS, token_entropy_bits
from tests.server.api.conftest import World

HOST_ROUTES = [
    ("POST", "/v1/work"),
    ("POST", "/v1/assignments/1/heartbeat"),
    ("POST", "/v1/assignments/1/start"),
    ("PUT", "/v1/assignments/1/result"),
    ("POST", "/v1/assignments/1/abandon"),
    ("POST", "/v1/assignments/1/error"),
    ("GET", "/v1/shards/1"),
    ("GET", "/v1/jobs/1/snapshots/0"),
    ("POST", "/v1/dedloc/jobs/1/join"),
    ("POST", "/v1/dedloc/jobs/1/refusal"),
    ("POST", "/v1/dedloc/jobs/1/progress"),
    ("POST", "/v1/dedloc/jobs/1/rounds/0/0/report"),
    ("POST", "/v1/dedloc/jobs/1/rounds/0/0/store/set"),
    ("PUT", "/v1/dedloc/jobs/1/rounds/0/0/parts/p?peer_id=x&size=1"),
    ("GET", "/v1/dedloc/jobs/1/rounds/0/0/total?peer_id=x&size=1"),
    ("PUT", "/v1/dedloc/jobs/1/states/1?peer_id=x"),
    ("POST", "/v1/mixtures/1/leases"),
    ("POST", "/v1/mixtures/1/calls"),
    ("GET", "/v1/mixtures/1/routing"),
    ("PUT", "/v1/mixtures/1/experts/0.0/checkpoint?step=1"),
    ("GET", "/v1/mixtures/1/experts/0.0/checkpoint"),
    ("GET", "/v1/dedloc/jobs/1/states/latest"),
]
ADMIN_ROUTES = [
    ("POST", "/v1/admin/join-tokens"),
    ("GET", "/v1/admin/join-tokens"),
    ("POST", "/v1/admin/join-tokens/1/revoke"),
    ("GET", "/v1/admin/hosts"),
    ("POST", "/v1/admin/hosts/1/revoke"),
    ("POST", "/v1/admin/hosts/1/release"),
    ("GET", "/v1/admin/project-key"),
    ("POST", "/v1/admin/project-key"),
    ("POST", "/v1/admin/project-key/rotations"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/1"),
    ("POST", "/v1/jobs/1/cancel"),
    ("POST", "/v1/jobs/1/signature"),
    ("GET", "/v1/jobs/1/recipe"),
    ("GET", "/v1/jobs/1/model"),
    ("GET", f"/v1/datasets/{'1' * 64}"),
    ("PUT", f"/v1/datasets/{'1' * 64}"),
    ("GET", "/v1/jobs/1/problems"),
    ("GET", "/metrics"),
    ("GET", "/v1/dedloc/jobs/1/digests/0"),
    ("GET", "/v1/dedloc/jobs/1/commits"),
    ("GET", "/v1/dedloc/jobs/1/aborts"),
    ("GET", "/v1/dedloc/jobs/1/state-refusals"),
    ("POST", "/v1/mixtures"),
    ("GET", "/v1/mixtures/1"),
]
PUBLIC_ROUTES = {("POST", "/v1/hosts"), ("GET", "/v1/health"), ("GET", "/v1/health/live"), ("GET", "/v1/project")}


def _template(path: str) -> str:
    """'/v1/jobs/1/snapshots/0?x=y' or '/v1/jobs/{job_id}/snapshots/{version}' -> '/v1/jobs/{}/snapshots/{}'."""
    parts = path.split("?")[0].split("/")
    return "/".join(
        "{}" if part.replace(".", "").isdigit() or part.startswith("{") or part in ("p", "set") else part
        for part in parts
    )


def test_every_route_is_public_or_guarded_and_listed_here(world: World) -> None:
    served = {
        (method.upper(), _template(path))
        for path, operations in world.sched.app.openapi()["paths"].items()
        for method in operations
    }
    listed = {(m, _template(p)) for m, p in HOST_ROUTES + ADMIN_ROUTES + sorted(PUBLIC_ROUTES)}
    assert served == listed


def _call(client, method: str, path: str):
    body = {} if method == "POST" else None
    return client.request(method, path, json=body) if body is not None else client.request(method, path, content=b"x")


@pytest.mark.parametrize(("method", "path"), HOST_ROUTES + ADMIN_ROUTES)
@pytest.mark.parametrize("token", ["missing", "wrong"])
def test_a_guarded_route_answers_401_with_a_bearer_challenge(world: World, method, path, token) -> None:
    before = world.fingerprint()
    client = world.sched.client(None if token == "missing" else "not-a-token", address=f"10.1.{token}")
    resp = _call(client, method, path)
    assert resp.status_code == 401, resp.text
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert "token" in resp.json()["detail"]
    assert world.fingerprint() == before


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/work"), ("POST", "/v1/assignments/-1/heartbeat")])
@pytest.mark.parametrize("token", ["missing", "wrong"])
def test_a_lean_route_refuses_a_wrong_token_before_it_reads_the_request(world: World, method, path, token) -> None:
    """The work and heartbeat routes read their body and path themselves (crowdtrain.server.api.lean):
    what they cannot parse is not looked at before the token is known, as on any other route."""
    client = world.sched.client(None if token == "missing" else "not-a-token", address=f"10.2.{token}")
    resp = client.request(method, path, content=b"{not json")
    assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer", resp.text
    assert world.alice.post("/v1/assignments/-1/heartbeat").status_code == 422


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_a_host_token_does_not_open_an_admin_route(world: World, method, path) -> None:
    before = world.fingerprint()
    resp = _call(world.alice, method, path)
    assert resp.status_code == 401 and resp.json() == {"detail": "admin token required"}
    assert world.fingerprint() == before


@pytest.mark.parametrize(("method", "path"), HOST_ROUTES)
def test_the_admin_token_is_not_a_host_token(world: World, method, path) -> None:
    resp = _call(world.sched.admin(), method, path)
    assert resp.status_code == 401 and resp.json() == {"detail": "unknown or revoked host token"}


def test_a_wrong_join_token_is_refused_403_and_registers_nobody(world: World) -> None:
    before = world.fingerprint()
    resp = world.sched.client().post("/v1/hosts", json={"join_token": "guess", "name": "mallory"})
    assert resp.status_code == 403 and resp.json() == {"detail": "invalid or revoked join token"}
    assert world.fingerprint() == before


def test_a_revoked_join_token_registers_nobody(world: World) -> None:
    admin = world.sched.admin()
    token = admin.post("/v1/admin/join-tokens", json={"label": "once"}).json()
    assert admin.post(f"/v1/admin/join-tokens/{token['id']}/revoke").json()["revoked"] is True
    before = world.fingerprint()
    resp = world.sched.client().post("/v1/hosts", json={"join_token": token["token"], "name": "late"})
    assert resp.status_code == 403
    assert world.fingerprint() == before


def test_issued_join_tokens_are_random_and_of_128_bits_or_more(world: World) -> None:
    """An operator cannot choose a weak one: the scheduler makes it, whatever the request says."""
    created = world.sched.admin().post("/v1/admin/join-tokens", json={"label": "weak?", "token": "a"}).json()
    assert created["token"] != "a" and token_entropy_bits(created["token"]) >= MIN_TOKEN_BITS


# (route, body, the field the 422 must name)
BAD_BODIES = [
    ("/v1/hosts", {"join_token": "x"}, "body.name"),
    ("/v1/hosts", {"join_token": "x", "name": "h", "resources": {"cpus": "4"}}, "body.resources.cpus"),
    (
        "/v1/hosts",
        {"join_token": "x", "name": "h", "resources": {"frameworks": ["jax"]}},
        "body.resources.frameworks.0",
    ),
    ("/v1/work", {"free_slots": "3"}, "body.free_slots"),
    ("/v1/work", {"free_slots": 1000}, "body.free_slots"),
    ("/v1/work", {"free_slots": 1, "cached_shards": ["not-a-sha"]}, "body.cached_shards.0"),
    ("/v1/assignments/1/error", {"message": "x" * 1001}, "body.message"),
    ("/v1/assignments/1/error", {}, "body.message"),
    ("/v1/assignments/-1/heartbeat", {}, "path.assignment_id"),
    ("/v1/assignments/99999999999999999999/abandon", {}, "path.assignment_id"),
    ("/v1/dedloc/jobs/1/progress", {"peer_id": "a b", "step": 0}, "body.peer_id"),
    ("/v1/dedloc/jobs/1/progress", {"peer_id": "a", "step": -2}, "body.step"),
    ("/v1/dedloc/jobs/1/rounds/0/0/report", {"peer_id": "a"}, "body.ok"),
    ("/v1/dedloc/jobs/1/rounds/0/0/store/add", {"peer_id": "a", "amount": 2**64}, "body.amount"),
    ("/v1/admin/join-tokens", {"label": ""}, "body.label"),
    ("/v1/jobs", {"name": "no-model"}, "body.model"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD_BODIES)
def test_a_bad_body_is_a_422_that_names_the_field_without_echoing_it(world: World, path, body, field) -> None:
    client = world.sched.admin() if path.startswith(("/v1/admin", "/v1/jobs")) else world.sched.client()
    if path.startswith(("/v1/work", "/v1/assignments", "/v1/dedloc")):
        client = world.bob
    before = world.fingerprint()
    resp = client.post(path, json=body)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail.startswith(field + ":") or f"; {field}:" in detail, detail
    assert "xxxxxxxxxx" not in detail
    assert world.fingerprint() == before


def test_a_body_that_is_not_json_is_a_422(world: World) -> None:
    resp = world.bob.post("/v1/work", content=b"{free_slots: 1", headers={"Content-Type": "application/json"})
    assert resp.status_code == 422 and resp.json()["detail"].startswith("body")
