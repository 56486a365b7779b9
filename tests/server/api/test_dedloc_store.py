"""The torch.distributed Store a DeDLOC round's members share (`/rounds/{step}/{attempt}/store/{op}`):
values travel as base64, and anything else is a 422 that says so and stores nothing."""

import pytest

from tests.server.api.conftest import dedloc_spec
from tests.server.dedloc_round import HandCollaboration
from tests.server.inprocess import ok, scheduler_app


@pytest.fixture
def live_round(tmp_path, private_redis):
    spec = dedloc_spec()
    spec["dedloc"] |= {"target_batch_size": 64, "micro_batch_size": 16, "max_group_size": 16}
    with scheduler_app(tmp_path, private_redis) as sched:
        job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
        team = HandCollaboration(job_id, [sched.register(f"peer-{i}") for i in range(2)])
        step, attempt = team.open_round(examples=40)
        yield team, f"{team.base}/rounds/{step}/{attempt}/store", private_redis


@pytest.mark.parametrize(
    ("op", "body", "field"),
    [
        ("set", {"key": "k", "value": "abc"}, "value"),
        ("set", {"key": "k", "value": "eA"}, "value"),  # unpadded
        ("set", {"key": "k", "value": "e A="}, "value"),
        ("compare_set", {"key": "k", "expected": "abc", "value": "eA=="}, "expected"),
        ("compare_set", {"key": "k", "expected": "eA==", "value": "!!!!"}, "value"),
    ],
)
def test_a_store_value_that_is_not_base64_is_a_422_naming_it(live_round, op, body, field) -> None:
    team, store, r = live_round
    peer = team.peers[0]
    before = sorted(r.scan_iter("*store*"))
    resp = peer.http.post(f"{store}/{op}", json={"peer_id": peer.peer_id} | body)
    assert resp.status_code == 422, resp.text
    assert field in resp.text and "is not base64" in resp.text
    assert sorted(r.scan_iter("*store*")) == before


def test_a_store_value_longer_than_the_bound_is_a_422(live_round) -> None:
    team, store, _ = live_round
    peer = team.peers[0]
    resp = peer.http.post(f"{store}/set", json={"peer_id": peer.peer_id, "key": "k", "value": "AAAA" * 250_001})
    assert resp.status_code == 422 and "value" in resp.text


def test_members_share_base64_values(live_round) -> None:
    team, store, _ = live_round
    a, b = team.peers
    ok(a.http.post(f"{store}/set", json={"peer_id": a.peer_id, "key": "k", "value": "eA=="}))
    got = ok(b.http.post(f"{store}/get", json={"peer_id": b.peer_id, "key": "k"})).json()
    assert got["value"] == "eA==" and got["found"]
    swapped = ok(
        b.http.post(f"{store}/compare_set", json={"peer_id": b.peer_id, "key": "k", "expected": "eA==", "value": ""})
    ).json()
    assert swapped["value"] == ""


@pytest.mark.parametrize(
    ("value", "amount"),
    [("eA==", 1), ("OTIyMzM3MjAzNjg1NDc3NTgwNw==", 1)],  # not a number; 2^63 - 1, which +1 overflows
    ids=["not-a-counter", "overflow"],
)
def test_adding_to_a_key_that_holds_no_counter_is_a_409_that_changes_nothing(live_round, value, amount) -> None:
    team, store, r = live_round
    peer = team.peers[0]
    ok(peer.http.post(f"{store}/set", json={"peer_id": peer.peer_id, "key": "k", "value": value}))
    before = {k: r.get(k) for k in r.scan_iter("*store*")}
    resp = peer.http.post(f"{store}/add", json={"peer_id": peer.peer_id, "key": "k", "amount": amount})
    assert resp.status_code == 409 and "holds no counter" in resp.text, resp.text
    assert {k: r.get(k) for k in r.scan_iter("*store*")} == before
