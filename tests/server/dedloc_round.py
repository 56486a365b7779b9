"""A DeDLOC collaboration driven by hand over the `/v1/dedloc` API: peers (one host client each, a
FastAPI TestClient or an httpx client of a running scheduler) join a job, report progress until a
round names them all, report the reduction's outcome, and report the parameters they hold. For tests
that need a live round or a committed step without running peer processes."""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

STORE_OPS = ("set", "get", "add", "check", "compare_set", "delete")
ADVANCE_S = 0.5  # seconds a driven scheduler clock moves on between rounds of reports (open_round)
HELD_AT_MOST = 0.2  # seconds an aimed progress report may ask to be held (Progress.wait): the round's own pace


class PeerGone(Exception):
    """A peer of the collaboration is no longer in it (it refused the job, or the job ended)."""


@dataclass
class HandPeer:
    http: httpx.Client
    peer_id: str
    step: int


class HandCollaboration:
    def __init__(self, job_id: int, hosts: Sequence[httpx.Client]):
        self.job_id = job_id
        self.peers = [self._join(http) for http in hosts]

    def _join(self, http: httpx.Client) -> HandPeer:
        for _ in range(200):
            resp = http.post(f"{self.base}/join", json={})
            if resp.status_code != 409 or "being prepared" not in resp.text:
                break
            time.sleep(0.1)
        assert resp.status_code == 200, resp.text
        return HandPeer(http, resp.json()["peer_id"], resp.json()["step"])

    def rejoin(self) -> None:
        """Every peer joins again, under a new peer id (one that left the collaboration is out of it)."""
        self.peers = [self._join(p.http) for p in self.peers]

    @property
    def base(self) -> str:
        return f"/v1/dedloc/jobs/{self.job_id}"

    def progress(self, peer: HandPeer, examples: int, attempt: int | None = None, digest: str | None = None) -> dict:
        body = {"peer_id": peer.peer_id, "step": peer.step, "examples": examples, "attempt": attempt}
        resp = peer.http.post(f"{self.base}/progress", json=body | ({"params_digest": digest} if digest else {}))
        if resp.status_code in (403, 404):
            raise PeerGone(resp.text)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def open_round(
        self, examples: int, timeout: float = 30.0, advance: Callable[[float], None] | None = None
    ) -> tuple[int, int]:
        """Report `examples` from every peer until a reduction names them all; its (step, attempt).
        With `advance` (a scheduler on a driven clock), the routes' clock is moved ADVANCE_S on after
        each round of reports, so that waits measured on it (matchmaking) end after as many reports
        however slowly a loaded machine sends them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if advance is not None:
                advance(ADVANCE_S)
            replies = [self.progress(p, examples) for p in self.peers]
            for peer, reply in zip(self.peers, replies, strict=True):
                peer.step = reply["step"]  # a peer told to resync holds no parameters here: it just follows
            plans = {(r["round"]["step"], r["round"]["attempt"]) for r in replies if r["action"] == "reduce"}
            if len(plans) == 1 and all(r["action"] == "reduce" for r in replies):
                return plans.pop()
            time.sleep(0.02)
        raise TimeoutError(f"no round named every peer within {timeout}s: {replies}")

    def is_reducing(self, step: int, attempt: int) -> bool:
        """Every peer is still a member of the running reduction (step, attempt), done with it or not."""
        for peer in self.peers:
            body = {"peer_id": peer.peer_id, "step": step, "examples": 1}
            resp = peer.http.post(f"{self.base}/progress", json=body)
            reply = resp.json() if resp.status_code == 200 else {}
            plan = reply.get("round") or {}
            if reply.get("action") == "wait" and reply.get("step") == step:
                continue
            if reply.get("action") != "reduce" or (plan.get("step"), plan.get("attempt")) != (step, attempt):
                return False
        return True

    def commit(
        self, examples: int, result_digest: str = "r" * 64, advance: Callable[[float], None] | None = None
    ) -> int:
        """Open a round (`open_round`, `advance` passed on) and report it done by every peer with the same
        result: the step it committed. Every peer then learns to apply it and is at the next step."""
        step, attempt = self.open_round(examples, advance=advance)
        for peer in self.peers:
            body = {"peer_id": peer.peer_id, "ok": True, "result_digest": result_digest}
            resp = peer.http.post(f"{self.base}/rounds/{step}/{attempt}/report", json=body)
            assert resp.status_code == 200, resp.text
        for peer in self.peers:
            assert self.progress(peer, 0, attempt=attempt)["action"] == "apply"
            peer.step = step + 1
        return step


class LiveRound:
    """A running reduction of a DeDLOC job whose members are `hosts`' peers, for requests that must
    reach a round's member routes: `ensure` opens it in a job of `spec` (the first time) and re-opens
    it when a request ended it (a failure report aborts it, its averaging timeout passes), with peers
    that join again when one has left (a refusal)."""

    def __init__(self, admin: httpx.Client, spec: dict, hosts: Sequence[httpx.Client], examples: int):
        self.admin, self.spec, self.hosts, self.examples = admin, spec, hosts, examples
        self.team: HandCollaboration | None = None
        self.step = self.attempt = 0
        self.reopened = self.aimed = 0

    def ensure(self) -> None:
        if self.team is None:
            self.team = self._open_job()
        elif self.team.is_reducing(self.step, self.attempt):
            return
        self.reopened += 1
        try:
            self.step, self.attempt = self.team.open_round(self.examples, timeout=15)
        except (PeerGone, TimeoutError):
            # A peer left (a refusal), or the requests made got the peers excluded: a new peer is
            # excluded at its first failed round, and these peers never commit one. Join again, as new.
            self.team.rejoin()
            self.step, self.attempt = self.team.open_round(self.examples)

    def _open_job(self) -> HandCollaboration:
        """A new job of `spec`, once it runs (before the project has a key, or it waits for a signature)."""
        resp = self.admin.post("/v1/jobs", json=self.spec)
        assert resp.status_code == 201 and resp.json()["status"] == "running", resp.text
        return HandCollaboration(resp.json()["job_id"], self.hosts)

    def aim(self, path_parameters: dict[str, Any] | None, query: dict[str, Any] | None, body: Any) -> None:
        """Point a request at the live round, as its first peer (whose host must send it)."""
        assert self.team is not None
        self.aimed += 1
        if path_parameters is not None and "op" in path_parameters:  # a Store call: each known one in turn
            path_parameters["op"] = STORE_OPS[self.aimed % len(STORE_OPS)]
        for name, value in (("job_id", self.team.job_id), ("step", self.step), ("attempt", self.attempt)):
            if path_parameters is not None and name in path_parameters:
                path_parameters[name] = value
        for fields in (query, body):
            if isinstance(fields, dict) and "peer_id" in fields:
                fields["peer_id"] = self.team.peers[0].peer_id
        if isinstance(body, dict) and type(body.get("wait")) in (int, float) and body["wait"] > HELD_AT_MOST:
            body["wait"] = HELD_AT_MOST  # a progress report held open: the generated value's bounds are its own test
