"""A DeDLOC peer's progress report held open while its answer would only say to go on waiting
(crowdtrain.server.services.dedloc_rounds.progress with `Progress.wait`): answered as soon as the
round moves (for a peer ready for its round, and for one idle with its share of the batch), at the
end of its wait when nothing moves, at once when the process holds its most, and at once when the
answer says something new (crowdtrain.server.services.dedloc_rounds.still_waiting)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from crowdtrain.core import keys
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas_dedloc import MAX_PROGRESS_WAIT, Progress, ProgressReply
from crowdtrain.launch.cluster import wait_for
from crowdtrain.server.services import dedloc_document, dedloc_peers, dedloc_rounds
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import scheduler_app


def _two_peers(app) -> tuple[int, dict[str, str], dict[str, int]]:
    data = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-dedloc.yaml").model_dump(mode="json")
    job = data | {"dedloc": data["dedloc"] | {"target_batch_size": 1000, "micro_batch_size": 10}}
    created = app.http.post("/v1/jobs", json=job, headers=app.admin_headers)
    assert created.status_code == 201, created.text
    job_id = created.json()["job_id"]
    peers = {}
    for name in ("a", "b"):
        joined = app.http.post(f"/v1/dedloc/jobs/{job_id}/join", json={}, headers=app.register_host(name))
        assert joined.status_code == 200, joined.text
        peers[name] = joined.json()["peer_id"]
    return job_id, peers, {name: int(p[1:].split("-")[0]) for name, p in peers.items()}


def _subscribers(r, job_id: int) -> int:
    return dict(r.pubsub_numsub(keys.dedloc_changed(job_id)))[keys.dedloc_changed(job_id).encode()]


def test_a_ready_peer_held_open_hears_the_round_start_from_the_report_that_starts_it(tmp_path, private_redis) -> None:
    r = private_redis
    with scheduler_app(tmp_path, r) as app:
        job_id, peers, host = _two_peers(app)
        now = dedloc_peers.peers(r, job_id)[peers["b"]].joined + 1.0

        def report(name: str, wait: float = 0.0):
            req = Progress(peer_id=peers[name], step=0, examples=500, wait=wait)
            return dedloc_rounds.progress(app.db, r, job_id, host[name], req, now=now)

        assert report("a").action == "accumulate"
        assert report("b").action == "matchmaking", "b is ready and waits for a"
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(report, "b", MAX_PROGRESS_WAIT)
            # b's report waits on the round's channel (evidence, not a sleep); then a's report starts the round.
            wait_for(lambda: _subscribers(r, job_id) == 1 or held.done(), 30, "b's report was not held")
            assert not held.done(), f"answered at once: {held.result()}"
            assert report("a").action == "reduce"
            answer = held.result(timeout=30)
        assert answer.action == "reduce" and answer.round is not None
        assert sorted(answer.round.members) == sorted(peers.values())
        assert _subscribers(r, job_id) == 0, "the held report left the channel"


def test_a_held_report_is_answered_at_the_end_of_its_wait_when_nothing_moves(tmp_path, private_redis) -> None:
    r = private_redis
    with scheduler_app(tmp_path, r) as app:
        job_id, peers, host = _two_peers(app)
        now = dedloc_peers.peers(r, job_id)[peers["b"]].joined + 1.0
        req = Progress(peer_id=peers["b"], step=0, examples=1000, wait=3.0)
        # b alone fills the step; a has claimed nothing, so matchmaking waits for it up to its deadline.
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(dedloc_rounds.progress, app.db, r, job_id, host["b"], req, now)
            wait_for(lambda: _subscribers(r, job_id) == 1 or held.done(), 30, "b's report was not held")
            assert not held.done(), f"answered at once: {held.result()}"
            assert held.result(timeout=30).action == "matchmaking"
        assert _subscribers(r, job_id) == 0


def test_a_report_is_answered_at_once_while_the_process_holds_its_most(
    tmp_path, private_redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = private_redis
    monkeypatch.setattr(dedloc_rounds, "_held", threading.BoundedSemaphore(1))
    with scheduler_app(tmp_path, r) as app:
        job_id, peers, host = _two_peers(app)
        now = dedloc_peers.peers(r, job_id)[peers["b"]].joined + 1.0
        req = Progress(peer_id=peers["b"], step=0, examples=1000, wait=MAX_PROGRESS_WAIT)
        assert dedloc_rounds._held.acquire(blocking=False)  # another report holds the only place
        try:
            assert dedloc_rounds.progress(app.db, r, job_id, host["b"], req, now=now).action == "matchmaking"
        finally:
            dedloc_rounds._held.release()
        assert _subscribers(r, job_id) == 0


def test_the_round_announces_a_change_and_only_a_change(private_redis) -> None:
    r = private_redis
    dedloc_document.open_job(r, 7)
    changes = r.pubsub(ignore_subscribe_messages=True)
    changes.subscribe(keys.dedloc_changed(7))
    wait_for(lambda: _subscribers(r, 7) == 1, 10, "not subscribed")
    rnd = dedloc_document.load(r, 7)
    assert rnd is not None
    dedloc_document.save(r, 7, rnd)  # the same document: nothing to announce
    rnd.candidates = ["p1"]
    dedloc_document.save(r, 7, rnd)
    dedloc_document.save(r, 7, rnd)
    heard = [m for _ in range(3) if (m := changes.get_message(timeout=1.0)) is not None]
    assert len(heard) == 1, heard
    changes.close()


def test_an_idle_peer_held_open_hears_its_round_start_when_the_others_fill_the_step(tmp_path, private_redis) -> None:
    """A peer that holds its share and asks to wait is answered when the step it waits on closes
    and every member is ready: straight to its round, with no poll in between."""
    r = private_redis
    with scheduler_app(tmp_path, r) as app:
        job_id, peers, host = _two_peers(app)
        now = dedloc_peers.peers(r, job_id)[peers["b"]].joined + 1.0

        def report(name: str, wait: float = 0.0):
            req = Progress(peer_id=peers[name], step=0, examples=500, wait=wait)
            return dedloc_rounds.progress(app.db, r, job_id, host[name], req, now=now)

        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(report, "a", MAX_PROGRESS_WAIT)
            wait_for(lambda: _subscribers(r, job_id) == 1 or held.done(), 30, "a's report was not held")
            assert not held.done(), f"answered at once: {held.result()}"
            assert report("b").action == "matchmaking", "b's report closes the step"
            answer = held.result(timeout=30)
        assert answer.action == "reduce", "a's held report made it ready, and the round start"
        assert report("b").action == "reduce"


def _reply(action: str, accumulated: int = 0, peers: int = 2, upload_state: bool = False) -> ProgressReply:
    return ProgressReply(
        action=action, step=3, state_step=3, accumulated=accumulated, peers=peers, upload_state=upload_state
    )


def test_a_held_report_waits_only_while_its_answer_says_nothing_new() -> None:
    still = dedloc_rounds.still_waiting
    for action in ("matchmaking", "wait"):
        assert still(_reply(action), _reply(action))
        assert not still(_reply(action, upload_state=True), _reply(action)), "an uploader is told at once"
    for action in ("reduce", "apply", "resync", "stop"):
        assert not still(_reply(action), _reply("matchmaking"))
    first = _reply("accumulate", accumulated=500)
    assert still(_reply("accumulate", accumulated=700), first), "more examples from the others: still idle"
    assert not still(_reply("accumulate", accumulated=400), first), "fewer: it may have examples to compute"
    assert not still(_reply("accumulate", accumulated=500, peers=3), first), "another share of the batch"
    assert not still(_reply("accumulate", accumulated=500), _reply("matchmaking")), "sent back to accumulating"
