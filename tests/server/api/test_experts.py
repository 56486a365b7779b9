"""`/v1/mixtures` in process (a real SQLite file, file storage, a private Redis): the operator creates a
mixture; a host reachable at its URL leases experts, keeps their checkpoints and loses a lease it does
not renew; a trainer follows the routing table; refusals say why and change nothing."""

from collections.abc import Iterator

import numpy as np
import pytest

from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.tensors import encode
from crowdtrain.server.api.deps import clock
from tests.server.inprocess import Scheduler, private_scheduler
from tests.stub_http import healthy, stub_server

LAYOUT = ExpertLayout(layers=1, grid=[2, 2], dim=4, hidden=8, k=2, heartbeat_seconds=10, lease_heartbeats=3)
T0 = 1_800_000_000.0


@pytest.fixture
def reachable() -> Iterator[str]:
    with stub_server(healthy) as url:
        yield url


@pytest.fixture
def sched(tmp_path) -> Iterator[Scheduler]:
    with private_scheduler(tmp_path) as s:
        s.now = T0
        s.app.dependency_overrides[clock] = lambda: s.now
        yield s


def create(sched: Scheduler, layout: ExpertLayout = LAYOUT) -> int:
    resp = sched.admin().post("/v1/mixtures", json={"name": "moe", "layout": layout.model_dump(mode="json")})
    assert resp.status_code == 201, resp.text
    return resp.json()["mixture_id"]


def test_a_reachable_host_leases_experts_and_a_trainer_sees_where_they_are(sched, reachable) -> None:
    mixture = create(sched)
    host = sched.register("expert-host")
    leases = host.post(f"/v1/mixtures/{mixture}/leases", json={"url": reachable, "capacity": 3}).json()
    assert [lease["uid"] for lease in leases["leases"]] == ["0.0.0", "0.0.1", "0.1.0"]
    assert leases["heartbeat_seconds"] == 10 and leases["leases"][0]["expires_in"] == 30
    assert leases["layout"]["grid"] == [2, 2]
    trainer = sched.register("trainer")
    table = trainer.get(f"/v1/mixtures/{mixture}/routing").json()
    assert {r["uid"]: r["url"] for r in table["routes"]} == dict.fromkeys(["0.0.0", "0.0.1", "0.1.0"], reachable)
    assert trainer.get(f"/v1/mixtures/{mixture}/routing", params={"since": table["version"]}).json()["routes"] == []
    view = sched.admin().get(f"/v1/mixtures/{mixture}").json()
    assert view["served"] == 3 and len(view["experts"]) == 4


def test_a_host_the_scheduler_cannot_reach_gets_no_expert_and_is_told_why(sched) -> None:
    mixture = create(sched)
    host = sched.register("nat")
    before = sched.rows()
    resp = host.post(f"/v1/mixtures/{mixture}/leases", json={"url": "http://127.0.0.1:9", "capacity": 2})
    assert resp.status_code == 422 and "cannot reach http://127.0.0.1:9/v1/health" in resp.json()["detail"]
    assert sched.rows() == before


def test_a_host_is_probed_only_when_there_is_an_expert_to_lease_or_it_holds_none(sched) -> None:
    """The connect-back probe costs a connection on both sides: a host that renews while every expert
    is leased is not probed; one that holds nothing is, so that an unreachable host is still told."""
    probes: list[str] = []

    def counted(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        probes.append(path)
        return healthy(method, path, body)

    mixture = create(sched)
    with stub_server(counted) as url:
        first, second, third = sched.register("first"), sched.register("second"), sched.register("third")
        call = {"url": url, "capacity": 3}
        assert len(first.post(f"/v1/mixtures/{mixture}/leases", json=call).json()["leases"]) == 3
        assert len(second.post(f"/v1/mixtures/{mixture}/leases", json=call).json()["leases"]) == 1
        assert len(probes) == 2
        for _ in range(3):  # both have room, but all four experts are leased
            assert first.post(f"/v1/mixtures/{mixture}/leases", json=call).status_code == 200
            assert second.post(f"/v1/mixtures/{mixture}/leases", json=call).status_code == 200
        assert len(probes) == 2
        standby = third.post(f"/v1/mixtures/{mixture}/leases", json=call)
        assert standby.status_code == 200 and standby.json()["leases"] == [] and len(probes) == 3
        # Asking for none (the layout alone, before the host listens) is no reason to probe it.
        asked = third.post(f"/v1/mixtures/{mixture}/leases", json={"url": "http://127.0.0.1:9", "capacity": 0})
        assert asked.status_code == 200 and asked.json()["leases"] == [] and len(probes) == 3


def test_a_checkpoint_is_kept_for_the_next_host_of_its_expert(sched, reachable) -> None:
    mixture = create(sched)
    first, second = sched.register("first"), sched.register("second")
    first.post(f"/v1/mixtures/{mixture}/leases", json={"url": reachable, "capacity": 1})
    blob = encode({"param/w": np.ones((2, 2), np.float32), "steps": np.array([7])})
    url = f"/v1/mixtures/{mixture}/experts/0.0.0/checkpoint"
    stored = first.put(f"{url}?step=7", content=blob, headers={"Content-Type": "application/octet-stream"})
    assert stored.status_code == 200 and stored.json() == {"uid": "0.0.0", "step": 7}
    assert first.put(f"{url}?step=7", content=blob).status_code == 409
    assert second.get(url).status_code == 403  # not its expert
    # The first host stops calling: after its lease ends, the second leases the expert and restores it.
    sched.now = T0 + 31
    leases = second.post(f"/v1/mixtures/{mixture}/leases", json={"url": reachable, "capacity": 1}).json()
    assert leases["leases"][0] == {
        "uid": "0.0.0",
        "replica": 0,
        "expires_in": 30,
        "checkpoint_step": 7,
        "has_checkpoint": True,
        "peer_step": 0,
    }
    assert second.get(url).content == blob
    assert first.get(url).status_code == 403
    assert len(sched.stored_files()) == 1


@pytest.mark.parametrize(
    ("step", "body", "status", "message"),
    [
        (8, b"not safetensors", 400, "not a safetensors file"),
        (8, b"\x00" * 600_000, 422, "at most"),
        (0, b"x", 422, "step"),
    ],
)
def test_a_bad_checkpoint_is_refused_and_nothing_is_stored(sched, reachable, step, body, status, message) -> None:
    mixture = create(sched)
    host = sched.register("h")
    host.post(f"/v1/mixtures/{mixture}/leases", json={"url": reachable, "capacity": 1})
    resp = host.put(f"/v1/mixtures/{mixture}/experts/0.0.0/checkpoint?step={step}", content=body)
    assert resp.status_code == status and message in resp.text
    assert sched.stored_files() == []


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/mixtures/99/leases", {"url": "http://127.0.0.1:1", "capacity": 1}, 404),
        ("GET", "/v1/mixtures/99/routing", None, 404),
        ("POST", "/v1/mixtures/{m}/leases", {"url": "ftp://x", "capacity": 1}, 422),
        ("POST", "/v1/mixtures/{m}/leases", {"url": "http://x/path", "capacity": 1}, 422),
        ("POST", "/v1/mixtures/{m}/leases", {"url": "http://x:1", "capacity": -1}, 422),
        ("GET", "/v1/mixtures/{m}/routing?since=-1", None, 422),
        ("GET", "/v1/mixtures/{m}/experts/9.9/checkpoint", None, 404),
        ("GET", "/v1/mixtures/{m}/experts/not-an-id/checkpoint", None, 422),
        ("POST", "/v1/mixtures/99/calls", {"seconds": 1, "experts": []}, 404),
        ("POST", "/v1/mixtures/{m}/calls", {"seconds": 0, "experts": []}, 422),
        ("POST", "/v1/mixtures/{m}/calls", {"seconds": 1, "experts": [{"uid": "x", "url": "http://a:1"}]}, 422),
        ("POST", "/v1/mixtures/{m}/calls", {"seconds": 1, "experts": [{"uid": "0.0", "url": "a"}]}, 422),
        (
            "POST",
            "/v1/mixtures/{m}/calls",
            {"seconds": 1, "experts": [{"uid": "0.0", "url": "http://a:1", "refused": -1}]},
            422,
        ),
        (
            "POST",
            "/v1/mixtures/{m}/calls",
            {"seconds": 1, "experts": [{"uid": "0.0", "url": "http://a:1"}] * 4097},
            422,
        ),
    ],
)
def test_requests_that_name_nothing_or_say_nonsense_get_a_4xx(sched, method, path, body, status) -> None:
    mixture = create(sched)
    host = sched.register("h")
    before = sched.rows()
    resp = host.request(method, path.format(m=mixture), json=body)
    assert resp.status_code == status, resp.text
    assert sched.rows() == before


def test_creating_a_mixture_needs_the_admin_and_a_layout_that_works(sched) -> None:
    host = sched.register("h")
    layout = LAYOUT.model_dump(mode="json")
    assert host.post("/v1/mixtures", json={"name": "m", "layout": layout}).status_code == 401
    bad = sched.admin().post("/v1/mixtures", json={"name": "m", "layout": {**layout, "k": 9}})
    assert bad.status_code == 422 and "above the 4 experts" in bad.text
    assert sched.admin().get("/v1/mixtures/5").status_code == 404


def test_a_trainers_report_shows_in_the_mixtures_figures_and_credits_the_host(sched, reachable) -> None:
    mixture = create(sched)
    host = sched.register("expert-host")
    leased = host.post(f"/v1/mixtures/{mixture}/leases", json={"url": reachable, "capacity": 1}).json()["leases"]
    uid = leased[0]["uid"]
    trainer = sched.register("trainer")
    report = {"seconds": 10, "experts": [{"uid": uid, "url": reachable, "answered": 20, "rows": 640, "late": 1}]}
    first = trainer.post(f"/v1/mixtures/{mixture}/calls", json=report)
    assert first.status_code == 200 and first.json() == {"counted": 1, "ignored": 0}
    sched.now += 10
    assert trainer.post(f"/v1/mixtures/{mixture}/calls", json=report).json() == {"counted": 1, "ignored": 0}
    # The host reporting on its own expert: not counted.
    assert host.post(f"/v1/mixtures/{mixture}/calls", json=report).json() == {"counted": 0, "ignored": 1}
    view = {e["uid"]: e for e in sched.admin().get(f"/v1/mixtures/{mixture}").json()["experts"]}
    assert (view[uid]["answered"], view[uid]["late"], view[uid]["failed"], view[uid]["refused"]) == (40, 2, 0, 0)
    assert view[uid]["answers_per_s"] == pytest.approx(40 / 20)  # over the reports' span, 10 s before the first
    credit = sched.admin().get("/v1/admin/hosts").json()
    assert next(h["credit"] for h in credit if h["name"] == "expert-host") > 0


def test_replicas_go_to_different_hosts_share_checkpoints_and_a_host_blamed_for_disagreeing_is_charged(
    sched, reachable
) -> None:
    mixture = create(sched, LAYOUT.model_copy(update={"replicas": 2}))
    lease = f"/v1/mixtures/{mixture}/leases"
    a, b, trainer = sched.register("a"), sched.register("b"), sched.register("trainer")
    with stub_server(healthy) as other:
        # Every expert's first replica is leased before any second one, and never two to one host.
        first = a.post(lease, json={"url": reachable, "capacity": 8}).json()["leases"]
        assert [(x["uid"], x["replica"]) for x in first] == [(u, 0) for u in ("0.0.0", "0.0.1", "0.1.0", "0.1.1")]
        assert a.post(lease, json={"url": reachable, "capacity": 8}).json()["leases"] == [
            {**x, "expires_in": 30} for x in first
        ]
        second = b.post(lease, json={"url": other, "capacity": 8}).json()["leases"]
        assert [(x["uid"], x["replica"]) for x in second] == [(u, 1) for u in ("0.0.0", "0.0.1", "0.1.0", "0.1.1")]
        table = trainer.get(f"/v1/mixtures/{mixture}/routing").json()["routes"]
        assert sorted((r["uid"], r["replica"], r["url"]) for r in table if r["uid"] == "0.0.0") == [
            ("0.0.0", 0, reachable),
            ("0.0.0", 1, other),
        ]
        # A replica's checkpoint is the other's to average with, and the newest of both is what restores.
        url = f"/v1/mixtures/{mixture}/experts/0.0.0/checkpoint"
        blob_a = encode({"param/w": np.ones((2, 2), np.float32), "steps": np.array([5])})
        assert a.put(f"{url}?step=5", content=blob_a).status_code == 200
        assert b.get(url, params={"of": "peer"}).content == blob_a
        assert a.get(url, params={"of": "peer"}).status_code == 404  # b has none yet
        blob_b = encode({"param/w": np.zeros((2, 2), np.float32), "steps": np.array([3])})
        assert b.put(f"{url}?step=3", content=blob_b).status_code == 200  # its own first, though older
        assert a.get(url, params={"of": "peer"}).content == blob_b
        assert b.get(url).content == blob_a  # the newest
        renewed = {x["uid"]: x for x in b.post(lease, json={"url": other, "capacity": 8}).json()["leases"]}
        assert (renewed["0.0.0"]["checkpoint_step"], renewed["0.0.0"]["peer_step"]) == (5, 5)
        # Compared answers: the trainer blames a's for three disagreements, b's for none.
        report = {
            "seconds": 10,
            "experts": [
                {"uid": "0.0.0", "url": reachable, "answered": 4, "compared": 2, "disagreed": 2},
                {"uid": "0.0.0", "url": other, "answered": 4, "compared": 2},
                {"uid": "0.0.1", "url": reachable, "answered": 4, "compared": 1, "disagreed": 1},
                {"uid": "0.0.1", "url": other, "answered": 4, "compared": 1},
                {"uid": "0.1.0", "url": other, "answered": 4, "compared": 1},
            ],
        }
        assert trainer.post(f"/v1/mixtures/{mixture}/calls", json=report).json() == {"counted": 5, "ignored": 0}
    hosts = {h["name"]: h for h in sched.admin().get("/v1/admin/hosts").json()}
    assert hosts["a"]["consecutive_refused"] == 3
    assert hosts["b"]["consecutive_refused"] == 0
    view = {(e["uid"], e["replica"]): e for e in sched.admin().get(f"/v1/mixtures/{mixture}").json()["experts"]}
    assert (view[("0.0.0", 0)]["compared"], view[("0.0.0", 0)]["disagreed"]) == (2, 2)
    assert view[("0.1.0", 1)]["compared"] == 1 and len(view) == 8
