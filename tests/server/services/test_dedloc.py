"""The DeDLOC rendezvous: round phases on a real Redis, and the `/v1/dedloc` API's refusals."""

import json

import httpx
import numpy as np
import pytest
import redis

from crowdtrain.core import keys
from crowdtrain.core.dedloc import dissenters
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.tensors import encode
from crowdtrain.launch.cluster import Cluster
from crowdtrain.server.ledger.models import Job
from crowdtrain.server.services import dedloc, dedloc_claims, dedloc_document, dedloc_peers
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import scheduler_app

SPEC = DedlocSpec(
    target_batch_size=100, micro_batch_size=10, matchmaking_timeout=0.3, averaging_timeout=0.3, max_group_size=2
)


class Clock:
    """The time the tests pass as `now`: it moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def later(self, r: redis.Redis, seconds: float) -> float:
        """`seconds` pass, in which every joined peer polls (stays live)."""
        self.now += seconds
        for peer, p in dedloc_peers.peers(r, 1).items():
            dedloc_peers.touch(r, 1, peer, p.host_id, self.now)
        return self.now


CLOCK = Clock()


def _report(r: redis.Redis, rnd: dedloc_document.Round, **examples: int) -> None:
    for peer, n in examples.items():
        r.hset(keys.dedloc_progress(1, rnd.step), peer, n)


def _joined(r: redis.Redis, *peers: str, relayed: tuple[str, ...] = ()) -> dedloc_document.Round:
    dedloc_document.open_job(r, 1)
    for i, p in enumerate(peers):
        dedloc_peers.join(r, 1, p, i + 1, p in relayed, CLOCK.now)
    return dedloc_document.load(r, 1)


def _establish(r: redis.Redis, *peers: str) -> None:
    """The peers have completed a round (at 5,000 examples a second): they are waited on, and struck."""
    dedloc_claims.record_round(r, 1, dict.fromkeys(peers, 100), dict.fromkeys(peers, 0.02))
    CLOCK.later(r, 0.1)  # and have accumulated for a while: their claims below are believed


def test_a_step_closes_at_the_target_and_waits_for_every_live_peer(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, "a", "b", "c", relayed=("c",))
    _report(r, rnd, a=40, b=50)
    assert dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now).phase == "accumulating"
    _report(r, rnd, b=60)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert rnd.phase == "matchmaking" and rnd.candidates == ["a", "b", "c"]
    rnd.ready.update(a=40, b=60, c=5)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert rnd.phase == "reducing" and rnd.members == ["a", "b", "c"] and rnd.total == 105
    assert rnd.groups == [["a", "b"]] and rnd.relayed == ["c"] and rnd.plan.needs_combining


def test_a_peer_not_ready_by_the_matchmaking_deadline_is_left_for_the_next_step(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, "a", "b", "c")
    _establish(r, "a", "b", "c")
    _report(r, rnd, a=60, b=60)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    rnd.ready.update(a=60, b=60)
    assert dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now).phase == "matchmaking"  # c is live and proven: awaited
    CLOCK.later(r, SPEC.matchmaking_timeout + 0.1)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert rnd.phase == "reducing" and rnd.members == ["a", "b"]
    assert dedloc.record_done(r, 1, rnd, SPEC, "a", 0, 0, "d1", CLOCK.now) is None
    commit = dedloc.record_done(r, 1, rnd, SPEC, "b", 0, 0, "d1", CLOCK.now)
    assert commit["members"] == ["a", "b"] and rnd.step == 1 and rnd.phase == "accumulating"
    assert dedloc.commit_of(r, 1, 0)["attempt"] == 0


def test_a_failed_attempt_is_retried_without_the_peer_that_does_not_come_back(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, "a", "b", "c")
    _report(r, rnd, a=50, b=50, c=50)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    rnd.ready.update(a=50, b=50, c=50)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    dedloc.record_done(r, 1, rnd, SPEC, "a", 0, 0, "d1", CLOCK.now)
    dedloc_claims.attend(r, 1, 0, 0, "b", 60)  # b waits in its all-reduce for c
    CLOCK.later(r, SPEC.averaging_timeout + 0.1)  # c never reports: the attempt times out for everyone
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert rnd.phase == "matchmaking" and rnd.attempt == 1 and rnd.done == {}
    assert r.hexists(keys.dedloc_aborts(1), "0:0")
    with pytest.raises(dedloc_document.RoundGone):
        dedloc.record_done(
            r, 1, rnd, SPEC, "b", 0, 0, "d1", CLOCK.now
        )  # a late report of the aborted attempt changes nothing
    assert dedloc.commit_of(r, 1, 0) is None
    rnd.ready.update(a=50, b=50)
    CLOCK.later(r, SPEC.matchmaking_timeout + 0.1)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert rnd.members == ["a", "b"] and rnd.attempt == 1


def test_members_that_disagree_on_the_result_abort_instead_of_forking(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, "a", "b")
    _report(r, rnd, a=50, b=50)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    rnd.ready.update(a=50, b=50)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    dedloc.record_done(r, 1, rnd, SPEC, "a", 0, 0, "d1", CLOCK.now)
    assert dedloc.record_done(r, 1, rnd, SPEC, "b", 0, 0, "d2", CLOCK.now) is None
    assert rnd.phase == "matchmaking" and rnd.step == 0 and dedloc.commit_of(r, 1, 0) is None
    with pytest.raises(dedloc_peers.NotAMember):
        rnd.phase, rnd.members = "reducing", ["a"]
        dedloc.record_done(r, 1, rnd, SPEC, "b", 0, 1, "d1", CLOCK.now)


def _reduce(r: redis.Redis, rnd: dedloc_document.Round, **examples: int) -> None:
    """Close the step with these peers' examples and make them the members."""
    _report(r, rnd, **examples)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    rnd.ready.update(examples)
    CLOCK.later(r, SPEC.matchmaking_timeout + 0.05)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert rnd.phase == "reducing", rnd


def test_a_peer_that_keeps_timing_out_is_excluded_and_the_others_commit(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, "a", "b", "c")
    _establish(r, "a", "b", "c")
    _reduce(r, rnd, a=50, b=50, c=50)
    for attempt in range(SPEC.exclude_after or 0):
        assert rnd.attempt == attempt and "c" in rnd.members
        dedloc.record_done(r, 1, rnd, SPEC, "a", 0, attempt, "d", CLOCK.now)
        dedloc.record_done(r, 1, rnd, SPEC, "b", 0, attempt, "d", CLOCK.now)
        CLOCK.later(r, SPEC.averaging_timeout + 0.05)  # c never reports
        dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
        assert rnd.phase == "matchmaking"
        rnd.ready.update(a=50, b=50, c=50)  # c keeps saying it is ready
        CLOCK.later(r, SPEC.matchmaking_timeout + 0.05)
        dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert dedloc.excluded(r, 1, SPEC) == {"c"}
    assert rnd.members == ["a", "b"], "the excluded peer is no member, even when it says it is ready"
    dedloc.record_done(r, 1, rnd, SPEC, "a", 0, rnd.attempt, "d", CLOCK.now)
    assert dedloc.record_done(r, 1, rnd, SPEC, "b", 0, rnd.attempt, "d", CLOCK.now)["members"] == ["a", "b"]
    CLOCK.later(r, 0.1)
    _report(r, rnd, a=30, b=30, c=500)
    dedloc.advance(r, 1, rnd, SPEC, 10, CLOCK.now)
    assert rnd.phase == "accumulating", "an excluded peer's examples do not close a step"
    assert r.hget(keys.dedloc_strikes(1), "a") is None, "a commit clears its members' strikes"


def test_the_member_whose_result_differs_from_the_majority_is_blamed(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, "a", "b", "c")
    _reduce(r, rnd, a=50, b=50, c=50)
    for peer, digest in (("a", "d1"), ("b", "d1"), ("c", "forged")):
        dedloc.record_done(r, 1, rnd, SPEC, peer, 0, 0, digest, CLOCK.now)
    assert rnd.phase == "matchmaking" and rnd.attempt == 1
    assert {keys.text(k): int(v) for k, v in r.hgetall(keys.dedloc_strikes(1)).items()} == {"c": 1}
    assert json.loads(r.hget(keys.dedloc_aborts(1), "0:0"))["blamed"] == ["c"]


def test_dissenters_are_the_minority_or_everyone_on_a_tie() -> None:
    assert dissenters({"a": "x", "b": "x", "c": "y"}) == ["c"]
    assert dissenters({"a": "x", "b": "y"}) == ["a", "b"]


def _commit(r: redis.Redis, rnd: dedloc_document.Round, spec: DedlocSpec) -> None:
    step, attempt = rnd.step, rnd.attempt
    for peer in rnd.members:
        dedloc.record_done(r, 1, rnd, spec, peer, step, attempt, "d", CLOCK.now)
    assert rnd.step == step + 1, rnd


def _close(r: redis.Redis, rnd: dedloc_document.Round, spec: DedlocSpec, **examples: int) -> None:
    CLOCK.later(r, 1.0)  # the peers accumulate: their claims are within what their rates allow
    _report(r, rnd, **examples)
    dedloc.advance(r, 1, rnd, spec, 10, CLOCK.now)
    rnd.ready.update(examples)
    CLOCK.later(r, spec.matchmaking_timeout + 0.05)
    dedloc.advance(r, 1, rnd, spec, 10, CLOCK.now)
    assert rnd.phase == "reducing", rnd


def test_the_same_members_meet_again_in_their_kept_process_group(private_redis) -> None:
    r, spec = private_redis, SPEC.model_copy(update={"max_group_size": 4})
    rnd = _joined(r, "a", "b", "c")
    _close(r, rnd, spec, a=50, b=50, c=50)
    assert rnd.sessions == ["0.0.1.0"]
    _commit(r, rnd, spec)
    for step in (1, 2):
        _close(r, rnd, spec, a=50, b=50, c=50)
        assert rnd.step == step and rnd.sessions == ["0.0.1.0"], "no new rendezvous for the same members"
        _commit(r, rnd, spec)


def test_a_member_gone_or_an_abort_makes_a_new_process_group(private_redis) -> None:
    r, spec = private_redis, SPEC.model_copy(update={"max_group_size": 4})
    rnd = _joined(r, "a", "b", "c")
    _close(r, rnd, spec, a=50, b=50, c=50)
    _commit(r, rnd, spec)
    _close(r, rnd, spec, a=60, b=60)  # c is gone: a and b meet without it
    assert rnd.members == ["a", "b"] and rnd.sessions == ["1.0.2.0"]
    dedloc.record_done(r, 1, rnd, spec, "a", 1, 0, "d", CLOCK.now)
    CLOCK.later(r, spec.averaging_timeout + 0.05)  # b never reports: the attempt is aborted
    dedloc.advance(r, 1, rnd, spec, 10, CLOCK.now)
    assert rnd.phase == "matchmaking" and rnd.kept == {}
    rnd.ready.update(a=60, b=60)
    CLOCK.later(r, spec.matchmaking_timeout + 0.05)
    dedloc.advance(r, 1, rnd, spec, 10, CLOCK.now)
    assert rnd.members == ["a", "b"] and rnd.sessions == ["1.1.3.0"], "a retry never reuses a group that failed"
    _commit(r, rnd, spec)
    _close(r, rnd, spec, a=60, b=60)
    assert rnd.sessions == ["1.1.3.0"]


def test_no_step_closes_past_max_steps(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, "a")
    rnd.step = 3
    _report(r, rnd, a=500)
    assert dedloc.advance(r, 1, rnd, SPEC, 3, CLOCK.now).phase == "accumulating"


def _dedloc_job(**changes) -> dict:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json", exclude_none=True)
    data.pop("assimilation")
    return (
        data
        | {
            "mode": "dedloc",
            "stop": {"target_accuracy": 0.9, "max_steps": 10},
            "dedloc": {"target_batch_size": 64, "micro_batch_size": 16},
        }
        | changes
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    cluster = Cluster(var_dir=tmp_path_factory.mktemp("dedloc-api"), assimilator_concurrency=1).start()
    try:
        with cluster.admin() as http:
            dedloc_job = http.post("/v1/jobs", json=_dedloc_job()).json()["job_id"]
            vc_job = http.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")).json()["job_id"]
        hosts = {}
        for name in ("alice", "mallory"):
            token = httpx.post(f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": name}).json()[
                "host_token"
            ]
            hosts[name] = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        peer = hosts["alice"].post(f"/v1/dedloc/jobs/{dedloc_job}/join", json={}).json()["peer_id"]
        yield cluster, dedloc_job, vc_job, hosts, peer
    finally:
        cluster.stop()


def _round_doc(cluster: Cluster, job_id: int) -> bytes:
    from crowdtrain.core import keys

    return redis.Redis.from_url(cluster.redis_url).get(keys.dedloc_round(job_id))


@pytest.mark.integration
def test_a_dedloc_spec_without_its_section_is_refused_and_nothing_stored(api) -> None:
    cluster, *_ = api
    with cluster.admin() as http:
        before = http.get("/v1/jobs").json()
        resp = http.post("/v1/jobs", json=_dedloc_job(dedloc=None) | {"dedloc": None})
        assert resp.status_code == 422 and "dedloc" in resp.text
        assert http.get("/v1/jobs").json() == before


@pytest.mark.integration
@pytest.mark.parametrize(
    ("who", "path", "body", "status", "message"),
    [
        ("mallory", "progress", {"step": 0, "examples": 5}, 403, "belongs to another host"),
        ("alice", "progress", {"step": 0, "examples": -5}, 422, "examples"),
        ("alice", "rounds/0/0/report", {"ok": True, "result_digest": "x"}, 409, "is not running"),
        ("alice", "rounds/0/0/store/set", {"key": "k", "value": "eA=="}, 409, "is not running"),
        ("alice", "rounds/0/0/store/format", {"key": "k"}, 404, "unknown store operation"),
    ],
)
def test_bad_requests_are_refused_and_change_nothing(api, who, path, body, status, message) -> None:
    cluster, job_id, _, hosts, peer = api
    before = _round_doc(cluster, job_id)
    resp = hosts[who].post(f"/v1/dedloc/jobs/{job_id}/{path}", json={"peer_id": peer} | body)
    assert resp.status_code == status and message in resp.text, resp.text
    assert _round_doc(cluster, job_id) == before


@pytest.mark.integration
def test_join_names_a_missing_job_or_the_wrong_mode(api) -> None:
    cluster, job_id, vc_job, hosts, _ = api
    assert hosts["alice"].post("/v1/dedloc/jobs/999/join", json={}).status_code == 404
    resp = hosts["alice"].post(f"/v1/dedloc/jobs/{vc_job}/join", json={})
    assert resp.status_code == 409 and "not 'dedloc'" in resp.text
    assert httpx.post(f"{cluster.url}/v1/dedloc/jobs/{job_id}/join", json={}).status_code == 401


@pytest.mark.integration
def test_parts_and_states_only_from_members(api) -> None:
    cluster, job_id, _, hosts, peer = api
    blob = encode({"g": np.zeros(4, np.float32)})
    resp = hosts["alice"].put(
        f"/v1/dedloc/jobs/{job_id}/rounds/0/0/parts/group-0",
        params={"peer_id": peer, "size": 4},
        content=np.zeros(4, np.float32).tobytes(),
    )
    assert resp.status_code == 409
    resp = hosts["alice"].put(f"/v1/dedloc/jobs/{job_id}/states/1", params={"peer_id": peer}, content=blob)
    assert resp.status_code == 403 and "did not commit step 0" in resp.text
    assert not (cluster.var_dir / "storage" / "jobs" / str(job_id) / "dedloc" / "state-00000001.safetensors").exists()


def test_a_peer_is_given_the_dedloc_section_as_the_job_recorded_it(tmp_path, private_redis) -> None:
    """A job recorded before a field of the section existed (here `compression`) is joined with the
    section it recorded, which is what its signed recipe holds, and the field's default applies."""
    spec = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-dedloc.yaml")
    with scheduler_app(tmp_path, private_redis) as app:
        created = app.http.post("/v1/jobs", json=spec.model_dump(mode="json"), headers=app.admin_headers)
        assert created.status_code == 201, created.text
        job_id = created.json()["job_id"]
        with app.db.begin() as s:
            job = s.get_one(Job, job_id)
            recorded = {k: v for k, v in job.spec["dedloc"].items() if k != "compression"}
            job.spec = {**job.spec, "dedloc": recorded}
        joined = app.http.post(f"/v1/dedloc/jobs/{job_id}/join", json={}, headers=app.register_host())
        assert joined.status_code == 200, joined.text
        assert joined.json()["recipe"]["dedloc"] == recorded
        assert DedlocSpec.model_validate(recorded).compression == "none"
