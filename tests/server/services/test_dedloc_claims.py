"""Claimed progress in the DeDLOC rendezvous: claims bounded by a peer's shown rate, new peers waited on
for one deadline at most, on a real Redis with a clock passed as `now`."""

import pytest
import redis

from crowdtrain.core import keys
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas_dedloc import Progress
from crowdtrain.server.services import dedloc, dedloc_claims, dedloc_document, dedloc_peers, dedloc_rounds
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import scheduler_app

SPEC = DedlocSpec(
    target_batch_size=1000, micro_batch_size=10, matchmaking_timeout=2, averaging_timeout=5, max_group_size=4
)
T0 = 1_000_000.0


def _joined(r: redis.Redis, established: tuple[str, ...], new: tuple[str, ...] = ()) -> dedloc_document.Round:
    """A job whose `established` peers each completed a round at 100 examples a second."""
    dedloc_document.open_job(r, 1)
    for i, p in enumerate(established + new):
        dedloc_peers.join(r, 1, p, i + 1, False, T0)
    dedloc_claims.record_round(r, 1, dict.fromkeys(established, 100), dict.fromkeys(established, 1.0))
    rnd = dedloc_document.load(r, 1)
    assert rnd is not None
    return rnd


def _claim(r: redis.Redis, now: float, **examples: int) -> None:
    for peer, n in examples.items():
        r.hset(keys.dedloc_progress(1, 0), peer, n)
        dedloc_peers.touch(r, 1, peer, dedloc_peers.peers(r, 1)[peer].host_id, now)


def test_a_claim_counts_only_within_what_the_peers_rate_allows(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, ("a", "b", "x"))
    now = T0 + 1.0  # 1 s at 100/s: up to 10 + 4 * 100 * 1 = 410 examples each
    _claim(r, now, a=400, b=400, x=10**9)
    assert dedloc.accumulated(r, 1, rnd, SPEC, now) == {"a": 400, "b": 400, "x": 0}, "a false claim counts nothing"
    assert dedloc.advance(r, 1, rnd, SPEC, 10, now).phase == "accumulating", "10^9 claimed examples close no step"
    now += 1.0
    _claim(r, now, a=500, b=500)
    assert dedloc.advance(r, 1, rnd, SPEC, 10, now).phase == "matchmaking"


def test_a_new_peer_that_claimed_nothing_is_awaited_once_then_passed_over_not_excluded(private_redis) -> None:
    """A late volunteer still loading the state is awaited while the established peers hold the batch
    (it could never join otherwise); not ready by the deadline, it is not waited on again."""
    r = private_redis
    rnd = _joined(r, ("a", "b"), new=("n",))
    now = T0 + 3.0
    _claim(r, now, a=500, b=500, n=0)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    assert rnd.phase == "matchmaking" and rnd.candidates == ["a", "b", "n"]
    rnd.ready.update(a=500, b=500)
    assert dedloc.advance(r, 1, rnd, SPEC, 10, now).phase == "matchmaking", "n is awaited"
    dedloc.advance(r, 1, rnd, SPEC, 10, now + SPEC.matchmaking_timeout + 0.1)
    assert rnd.phase == "reducing" and rnd.members == ["a", "b"]
    assert dedloc.excluded(r, 1, SPEC) == set(), "n claimed nothing: it is not excluded"
    assert dedloc.awaited(r, 1, rnd) == {"a", "b"}, "n is not waited on again"


def test_a_peer_not_ready_by_the_deadline_is_not_waited_on_again_until_it_takes_part(private_redis) -> None:
    """An established peer that never comes ready (one whose claims run ahead of its bound, say)
    costs the others one deadline, not one per step."""
    r = private_redis
    rnd = _joined(r, ("a", "b", "c"))
    now = T0 + 3.0
    _claim(r, now, a=400, b=400, c=300)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    rnd.ready.update(a=400, b=400)
    assert dedloc.advance(r, 1, rnd, SPEC, 10, now).phase == "matchmaking", "c is awaited"
    dedloc.advance(r, 1, rnd, SPEC, 10, now + SPEC.matchmaking_timeout + 0.1)
    assert rnd.members == ["a", "b"] and dedloc.excluded(r, 1, SPEC) == set(), "established: not excluded"
    assert dedloc.awaited(r, 1, rnd) == {"a", "b"}
    dedloc_claims.take_part(r, 1, ["a", "b", "c"])
    assert dedloc.awaited(r, 1, rnd) == {"a", "b", "c"}, "having taken part, c is waited on again"


def test_a_new_peer_that_claimed_examples_is_waited_on_until_the_deadline_then_excluded(private_redis) -> None:
    """A late volunteer accumulating on the current state joins the round even when the established
    peers hold a batch without it; one that never comes ready costs one deadline and is excluded."""
    r = private_redis
    rnd = _joined(r, ("a", "b"), new=("n",))
    now = T0 + 3.0
    _claim(r, now, a=500, b=500, n=300)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    rnd.ready.update(a=500, b=500)
    assert dedloc.advance(r, 1, rnd, SPEC, 10, now).phase == "matchmaking", "n claimed examples: it is awaited"
    dedloc.advance(r, 1, rnd, SPEC, 10, now + SPEC.matchmaking_timeout + 0.1)
    assert rnd.phase == "reducing" and rnd.members == ["a", "b"]
    assert dedloc.excluded(r, 1, SPEC) == {"n"}


def test_a_new_peer_that_is_ready_takes_part_in_the_round(private_redis) -> None:
    """A late volunteer must be able to complete a round to become established."""
    r = private_redis
    rnd = _joined(r, ("a", "b"), new=("n",))
    now = T0 + 3.0
    _claim(r, now, a=500, b=500, n=300)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    rnd.ready.update(a=500, b=500, n=300)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    assert rnd.members == ["a", "b", "n"] and rnd.total == 1300


def test_a_new_peer_that_claims_and_never_comes_ready_is_excluded_at_the_deadline(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, ("a", "b"), new=("n",))
    now = T0 + 3.0
    _claim(r, now, a=400, b=400, n=300)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    rnd.ready.update(a=400, b=400)
    assert dedloc.advance(r, 1, rnd, SPEC, 10, now).phase == "matchmaking", "a and b lack a batch: n is awaited"
    dedloc.advance(r, 1, rnd, SPEC, 10, now + SPEC.matchmaking_timeout + 0.1)
    assert rnd.phase == "reducing" and rnd.members == ["a", "b"]
    assert dedloc.excluded(r, 1, SPEC) == {"n"}


@pytest.mark.parametrize("established", [False, True], ids=["new", "established"])
def test_a_member_that_never_takes_part_is_excluded_at_once_only_when_new(private_redis, established) -> None:
    r = private_redis
    rnd = _joined(r, ("a", "b", "f") if established else (), new=() if established else ("a", "b", "f"))
    now = T0 + 3.0
    _claim(r, now, a=400, b=400, f=400)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    rnd.ready.update(a=400, b=400, f=400)
    dedloc.advance(r, 1, rnd, SPEC, 10, now)
    assert rnd.phase == "reducing" and rnd.members == ["a", "b", "f"]
    dedloc_claims.attend(r, 1, 0, 0, "a", 60)  # a and b meet and wait for f, which never comes
    dedloc_claims.attend(r, 1, 0, 0, "b", 60)
    dedloc.advance(r, 1, rnd, SPEC, 10, now + SPEC.averaging_timeout + 0.1)
    assert rnd.phase == "matchmaking" and rnd.attempt == 1
    assert dedloc.excluded(r, 1, SPEC) == (set() if established else {"f"})
    assert rnd.candidates == (["a", "b", "f"] if established else ["a", "b"])


def test_a_committed_round_records_each_members_rate(private_redis) -> None:
    r = private_redis
    rnd = _joined(r, (), new=("a", "b"))
    _claim(r, T0 + 4.0, a=400, b=600)
    dedloc.advance(r, 1, rnd, SPEC, 10, T0 + 4.0)
    rnd.ready.update(a=400, b=600)
    rnd.claimed_at.update(a=T0 + 1.0, b=T0 + 2.0)  # after their downloads
    rnd.ready_at.update(a=T0 + 4.0, b=T0 + 4.0)
    dedloc.advance(r, 1, rnd, SPEC, 10, T0 + 4.0)
    for peer in ("a", "b"):
        dedloc.record_done(r, 1, rnd, SPEC, peer, 0, 0, "d", T0 + 5.0)
    assert rnd.step == 1 and dedloc_claims.rates(r, 1) == {"a": 400 / 3, "b": 300.0}
    assert rnd.opened == T0 + 5.0


def _dedloc_job() -> dict:
    data = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-dedloc.yaml").model_dump(mode="json")
    return data | {"dedloc": data["dedloc"] | {"target_batch_size": 1000, "micro_batch_size": 10}}


def test_excluded_and_unproven_claims_are_not_told_to_the_others(tmp_path, private_redis) -> None:
    """What a peer hears the others hold (`accumulated`, which stops it computing at the batch)
    counts no excluded peer, and no claim beyond its bound; a claim beyond it is never ready."""
    r = private_redis
    with scheduler_app(tmp_path, r) as app:
        created = app.http.post("/v1/jobs", json=_dedloc_job(), headers=app.admin_headers)
        assert created.status_code == 201, created.text
        job_id = created.json()["job_id"]
        peers = {}
        for name in ("honest", "other", "fake", "gone"):
            joined = app.http.post(f"/v1/dedloc/jobs/{job_id}/join", json={}, headers=app.register_host(name))
            assert joined.status_code == 200, joined.text
            peers[name] = joined.json()["peer_id"]
        host = {name: int(p[1:].split("-")[0]) for name, p in peers.items()}
        dedloc_claims.shut_out(r, job_id, [peers["gone"]])
        now = dedloc_peers.peers(r, job_id)[peers["fake"]].joined + 1.0

        def report(name: str, examples: int, at: float):
            req = Progress(peer_id=peers[name], step=0, examples=examples)
            return dedloc_rounds.progress(app.db, r, job_id, host[name], req, now=at)

        report("gone", 900, now)
        assert report("honest", 50, now).accumulated == 50, "an excluded peer's claim counts for nothing"
        dedloc_claims.record_round(r, job_id, {peers["fake"]: 100}, {peers["fake"]: 1.0})  # fake: 100/s shown
        report("fake", 10**9, now)
        assert report("honest", 50, now).accumulated == 50, "a claim beyond 10 + 4 x 100/s x 1 s counts nothing"
        # 3 s in, each may claim 1010: the honest peers close the step, and nobody waits for the fake.
        assert report("honest", 500, now + 2.0).accumulated == 500
        assert report("other", 500, now + 2.0).action == "matchmaking"
        assert report("honest", 500, now + 2.0).action == "reduce"
        assert report("fake", 10**9, now + 2.0).action == "accumulate", "a claim beyond its bound is never ready"
        rnd = dedloc_document.load(r, job_id)
        assert rnd is not None and rnd.members == sorted([peers["honest"], peers["other"]]) and rnd.total == 1000
