"""Which uploaded DeDLOC state is the collaboration's (crowdtrain.server.services.dedloc_states), over
the API in process: a real SQLite file, file storage and a private Redis; peers driven by hand, on a
clock the test drives (the routes read the time from crowdtrain.server.api.deps.clock): each request
moves it on by TICK seconds, as if the peers trained that long between reports, and only the test
moves it further, so that no liveness window passes by itself on a loaded machine."""

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from crowdtrain.core import dedloc as math
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.core.tensors import decode, encode
from crowdtrain.server.api.deps import clock
from crowdtrain.server.services import dedloc, dedloc_peers
from tests.server.api.conftest import dedloc_spec
from tests.server.dedloc_round import HandCollaboration, HandPeer
from tests.server.inprocess import Scheduler, ok, scheduler_app

TICK = 0.02  # seconds of the routes' clock per request


class DrivenClock:
    """The routes' clock: TICK seconds later at every read, and `advance`d by the test."""

    def __init__(self, start: float) -> None:
        self.t = start

    def __call__(self) -> float:
        self.t += TICK
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class Committed:
    """A DeDLOC job whose step 0 three peers committed; `good` is the state they hold after it."""

    sched: Scheduler
    r: redis.Redis
    team: HandCollaboration
    good: bytes
    zeroed: bytes
    clock: DrivenClock

    @property
    def digest(self) -> str:
        return math.digest(params_of(self.good))

    def put(self, peer: HandPeer, blob: bytes, step: int = 1):
        return peer.http.put(f"{self.team.base}/states/{step}", params={"peer_id": peer.peer_id}, content=blob)

    def report(self, peer: HandPeer, digest: str | None = None) -> dict:
        return self.team.progress(peer, 0, digest=digest or self.digest)

    def state_file(self, step: int = 1) -> Path:
        return self.sched.storage_dir / "jobs" / str(self.team.job_id) / "dedloc" / f"state-{step:08d}.safetensors"

    def latest_step(self) -> int:
        return int(ok(self.team.peers[0].http.get(f"{self.team.base}/states/latest")).headers["X-Crowdtrain-Step"])


def params_of(blob: bytes) -> dict[str, np.ndarray]:
    return {k: v for k, v in decode(blob).items() if not k.startswith("__")}


@pytest.fixture
def committed(tmp_path, private_redis) -> Iterator[Committed]:
    spec = dedloc_spec()
    spec["dedloc"] |= {"target_batch_size": 96, "micro_batch_size": 16, "exclude_after": 2}
    with scheduler_app(tmp_path, private_redis) as sched:
        test_clock = DrivenClock(time.time())
        sched.app.dependency_overrides[clock] = test_clock
        job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
        team = HandCollaboration(job_id, [sched.register(f"peer-{i}") for i in range(3)])
        state0 = ok(team.peers[0].http.get(f"{team.base}/states/latest")).content
        assert team.commit(examples=40) == 0
        tensors = decode(state0)
        good = encode({k: v + np.float32(0.5) for k, v in tensors.items()})
        zeroed = encode({k: v * 0 for k, v in tensors.items()})
        yield Committed(sched, private_redis, team, good, zeroed, test_clock)


def test_a_state_whose_parameters_are_not_the_members_is_refused_charged_and_nothing_stored(committed) -> None:
    c = committed
    poisoner, honest, _ = c.team.peers
    for peer in c.team.peers:  # everyone, the poisoner too, reports the real parameters
        c.report(peer)
    resp = c.put(poisoner, c.zeroed)
    assert resp.status_code == 422, resp.text
    assert "not" in resp.json()["detail"] and "refused" in resp.json()["detail"]
    assert not c.state_file().exists() and c.latest_step() == 0
    again = c.put(poisoner, c.zeroed)  # the same refusal again is one strike, not two
    assert again.status_code == 422
    assert c.sched.http.get(f"{c.team.base}/state-refusals", headers=c.sched.admin_headers).json() == {
        poisoner.peer_id: 1
    }
    stored = c.put(honest, c.good)
    assert stored.status_code == 200 and stored.json()["status"] == "stored", stored.text
    assert math.digest(params_of(c.state_file().read_bytes())) == c.digest and c.latest_step() == 1


def test_a_state_before_a_majority_of_the_members_agree_is_a_409_and_changes_nothing(committed) -> None:
    c = committed
    uploader = c.team.peers[0]
    c.report(uploader)  # one of three: no majority
    resp = c.put(uploader, c.good)
    assert resp.status_code == 409 and "have not agreed" in resp.json()["detail"], resp.text
    assert not c.state_file().exists() and c.latest_step() == 0
    c.report(c.team.peers[1], digest="f" * 64)  # two of three, but differing
    assert c.put(uploader, c.good).status_code == 409
    assert c.sched.http.get(f"{c.team.base}/state-refusals", headers=c.sched.admin_headers).json() == {}


def test_the_same_good_state_twice_is_stored_once(committed) -> None:
    c = committed
    for peer in c.team.peers:
        c.report(peer)
    assert ok(c.put(c.team.peers[0], c.good)).json()["status"] == "stored"
    before = c.state_file().read_bytes()
    assert ok(c.put(c.team.peers[1], c.good)).json()["status"] == "duplicate"
    assert ok(c.put(c.team.peers[0], c.good)).json()["status"] == "duplicate"
    assert c.state_file().read_bytes() == before and c.latest_step() == 1


def test_the_designated_uploader_is_asked_first_and_the_others_once_it_is_refused(committed) -> None:
    c = committed
    commits = c.sched.http.get(f"{c.team.base}/commits", headers=c.sched.admin_headers).json()
    uploader = next(p for p in c.team.peers if p.peer_id == commits["0"]["uploader"])
    others = [p for p in c.team.peers if p is not uploader]
    # The second report makes a majority, but the designated uploader goes first.
    assert [c.report(p)["upload_state"] for p in others] == [False, False]
    assert c.report(uploader)["upload_state"] is True
    assert c.put(uploader, c.zeroed).status_code == 422
    assert c.report(uploader)["upload_state"] is False
    assert [c.report(p)["upload_state"] for p in others] == [True, True]  # the backups are asked
    assert ok(c.put(others[0], c.good)).json()["status"] == "stored"
    assert [c.report(p)["upload_state"] for p in c.team.peers] == [False, False, False]


def test_the_others_are_asked_once_the_designated_uploader_is_silent_for_the_liveness_window(committed) -> None:
    c = committed
    commits = c.sched.http.get(f"{c.team.base}/commits", headers=c.sched.admin_headers).json()
    uploader = next(p for p in c.team.peers if p.peer_id == commits["0"]["uploader"])
    others = [p for p in c.team.peers if p is not uploader]
    window = dedloc_peers.liveness_window(DedlocSpec.model_validate(dedloc_spec()["dedloc"]))
    assert [c.report(p)["upload_state"] for p in others] == [False, False]
    c.clock.advance(window - 0.5)
    assert [c.report(p)["upload_state"] for p in others] == [False, False]  # it may still upload
    c.clock.advance(1.0)
    assert [c.report(p)["upload_state"] for p in others] == [True, True]
    assert ok(c.put(others[1], c.good)).json()["status"] == "stored"


def test_a_peer_whose_states_are_refused_is_excluded_after_the_configured_strikes(committed) -> None:
    c = committed
    poisoner = c.team.peers[0]
    spec = DedlocSpec.model_validate(dedloc_spec()["dedloc"] | {"target_batch_size": 96, "exclude_after": 2})
    for step in (1, 2):
        for peer in c.team.peers:
            c.report(peer)
        assert c.put(poisoner, c.zeroed, step=step).status_code == 422
        assert ok(c.put(c.team.peers[1], c.good, step=step)).json()["status"] == "stored"
        excluded = dedloc.excluded(c.r, c.team.job_id, spec)
        assert (poisoner.peer_id in excluded) == (step == 2), excluded
        if step == 1:
            c.team.commit(examples=40)  # a commit clears strikes of aborts, not refused states
    # The next step is closed without it, although it reports examples like the others.
    honest = c.team.peers[1:]
    c.team.peers = honest
    c.team.progress(poisoner, 50)
    reply = c.team.progress(honest[0], 10)  # the others are not told to count the excluded peer's examples
    assert reply["action"] == "accumulate" and (reply["accumulated"], reply["peers"]) == (10, 2), reply
    step, attempt = c.team.open_round(examples=50)
    members = c.team.progress(honest[0], 50)["round"]["members"]
    assert poisoner.peer_id not in members and len(members) == 2, (step, attempt, members)


def test_a_state_no_member_can_upload_sends_the_collaboration_back_to_the_newest_accepted_one(committed) -> None:
    c = committed
    poisoner, *others = c.team.peers
    for peer in c.team.peers:
        c.report(peer)
    for peer in others:  # the honest members leave before uploading
        ok(peer.http.post(f"{c.team.base}/refusal", json={"peer_id": peer.peer_id, "message": "leaving"}))
    assert c.put(poisoner, c.zeroed).status_code == 422
    newcomer = HandCollaboration(c.team.job_id, [c.sched.register("newcomer")])
    assert newcomer.peers[0].step == 1 and c.latest_step() == 0  # told the step, syncs to the state of 0
    newcomer.peers[0].step = 0
    reply = newcomer.progress(newcomer.peers[0], 10)
    assert reply["action"] == "accumulate" and reply["step"] == 0, reply  # not told to resync to step 1
    assert c.sched.http.get(f"{c.team.base}/commits", headers=c.sched.admin_headers).json() == {}
    # The round waits in matchmaking for the member who stayed (the poisoner) until its timeout on the
    # routes' clock: driven on with each report, not by however many requests a loaded machine sends.
    assert newcomer.commit(examples=100, advance=c.clock.advance) == 0
    assert newcomer.progress(newcomer.peers[0], 0, digest=c.digest)["upload_state"] is True
    assert ok(c.put(newcomer.peers[0], c.good)).json()["status"] == "stored" and c.latest_step() == 1


def test_a_step_committed_after_the_job_ended_leaves_the_jobs_version_at_its_last_state(committed) -> None:
    """The members of a running round learn of the job's end only after it: their commit is no version
    of the job, whose version stays that of the state it ended at (what it exported)."""
    c = committed
    admin = c.sched.admin()
    version = ok(admin.get(f"/v1/jobs/{c.team.job_id}")).json()["param_version"]
    step, attempt = c.team.open_round(examples=40)
    assert step == version == 1
    ok(admin.post(f"/v1/jobs/{c.team.job_id}/cancel"))
    for peer in c.team.peers:
        body = {"peer_id": peer.peer_id, "ok": True, "result_digest": "r" * 64}
        ok(peer.http.post(f"{c.team.base}/rounds/{step}/{attempt}/report", json=body))
    assert step in {int(s) for s in ok(admin.get(f"{c.team.base}/commits")).json()}, "the round still committed"
    job = ok(admin.get(f"/v1/jobs/{c.team.job_id}")).json()
    assert job["status"] == "cancelled" and job["param_version"] == version
