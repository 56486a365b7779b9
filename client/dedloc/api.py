"""The scheduler's `/v1/dedloc` API as a peer sees it, through the client's HTTP layer
(crowdtrain.client.server_http): the scheduler's origin only, no redirect, replies read up to a bound
and checked against their schema, a few short retries of 5xx, 429 and transport errors."""

import base64
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from crowdtrain.client.server_http import (
    UNTIL_STOPPED,
    BadReply,
    Refused,
    ServerHTTP,
    detail,
    parse_reply,
    read_at_most,
)
from crowdtrain.core.schemas import HostRegistered
from crowdtrain.core.schemas_dedloc import PeerJoined, PeerRefusal, Progress, ProgressReply, StoreOp, StoreReply

__all__ = ["BadReply", "PeerAPI", "Refused", "b64"]
ATTEMPTS = 5  # tries of one request: a round's deadline is seconds away, a peer cannot wait long
MAX_STATE_BYTES = 4 * 2**30  # the most a state download may be when the caller names no bound


class PeerAPI:
    def __init__(self, server: str, timeout: float = 120.0):
        self.server = ServerHTTP(server, timeout, attempts=ATTEMPTS, first_wait=0.2, max_wait=3.0)
        self.http = self.server.http
        self.job_id: int | None = None
        self.peer_id = ""

    def close(self) -> None:
        self.server.close()

    def request(self, method: str, url: str, **kw: Any) -> bytes:
        """The reply's body (crowdtrain.client.server_http.ServerHTTP.request, with the token sent)."""
        return self.server.request(method, url, **kw)

    def register(self, join_token: str, name: str) -> HostRegistered:
        """Register a host and use its token from now on. A scheduler not up yet is waited for, as the
        volunteer client waits: a peer started before its server joins once the server is up."""
        body = {"join_token": join_token, "name": name}
        reply = self.request("POST", "/v1/hosts", attempts=UNTIL_STOPPED, json=body)
        registered = parse_reply(HostRegistered, reply)
        self.use_token(registered.host_token)
        return registered

    def use_token(self, host_token: str) -> None:
        self.http.headers["Authorization"] = f"Bearer {host_token}"

    def refuse(self, message: str) -> None:
        """Tell the scheduler this peer will not train its job, and why; it leaves the collaboration."""
        body = PeerRefusal(peer_id=self.peer_id, message=message[:1000])
        self.request("POST", f"{self.base}/refusal", json=body.model_dump())

    @property
    def base(self) -> str:
        return f"/v1/dedloc/jobs/{self.job_id}"

    def join(self, job_id: int, relayed: bool) -> PeerJoined:
        self.job_id = job_id
        for _ in range(100):
            try:
                joined = parse_reply(PeerJoined, self.request("POST", f"{self.base}/join", json={"relayed": relayed}))
                self.peer_id = joined.peer_id
                return joined
            except Refused as exc:
                if exc.status != 409 or "being prepared" not in str(exc):
                    raise
                time.sleep(0.5)
        raise TimeoutError(f"job {job_id} was never ready")

    def shard(self, shard_id: int, size: int) -> bytes:
        """The shard's bytes, at most the `size` its reference declared."""
        return self.request("GET", f"/v1/shards/{shard_id}", limit=size)

    def progress(
        self, step: int, examples: int, attempt: int | None, params_digest: str | None, wait: float = 0.0
    ) -> ProgressReply:
        """Report the examples held for `step`; with `wait`, the scheduler may hold an answer that would
        only say to go on waiting for up to that many seconds, until the round moves (Progress.wait)."""
        body = Progress(
            peer_id=self.peer_id, step=step, examples=examples, attempt=attempt, params_digest=params_digest, wait=wait
        )
        return parse_reply(ProgressReply, self.request("POST", f"{self.base}/progress", json=body.model_dump()))

    def report(self, step: int, attempt: int, ok: bool, result_digest: str = "", message: str = "") -> str:
        reply = self.request(
            "POST",
            f"{self.base}/rounds/{step}/{attempt}/report",
            json={"peer_id": self.peer_id, "ok": ok, "result_digest": result_digest, "message": message[:1000]},
        )
        return _status(reply)

    def store(self, step: int, attempt: int, op: str, **fields: Any) -> StoreReply:
        body = StoreOp(peer_id=self.peer_id, **fields)
        return parse_reply(
            StoreReply, self.request("POST", f"{self.base}/rounds/{step}/{attempt}/store/{op}", json=body.model_dump())
        )

    def put_part(self, step: int, attempt: int, part: str, size: int, chunks: Iterable[bytes]) -> str:
        """Stream a part of `size` float32 (raw little-endian) as `chunks` come; sent once (a stream
        cannot be replayed: a failure fails the round)."""
        reply = self.request(
            "PUT",
            f"{self.base}/rounds/{step}/{attempt}/parts/{part}",
            attempts=1,
            params={"peer_id": self.peer_id, "size": size},
            content=chunks,
        )
        return _status(reply)

    def total_into(
        self, step: int, attempt: int, out: np.ndarray, chunk_floats: int, arrived: Callable[[int, int], None]
    ) -> None:
        """Read the round's total into `out` (float32) as the scheduler sums it, calling
        `arrived(start, stop)` for each chunk of `chunk_floats` floats once it is all in `out`."""
        raw = out.view(np.uint8)
        got, announced = 0, 0
        url = f"{self.base}/rounds/{step}/{attempt}/total"
        req = self.server.build("GET", url, params={"peer_id": self.peer_id, "size": out.size})
        resp = self.http.send(req, stream=True)
        try:
            if resp.status_code >= 300:
                raise Refused(resp.status_code, detail(read_at_most(resp, 64 * 1024, "error reply")))
            for piece in resp.iter_raw():
                if got + len(piece) > raw.size:
                    raise ValueError(f"step {step} attempt {attempt}: the total is longer than {out.size} floats")
                raw[got : got + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
                got += len(piece)
                while announced < out.size and (got // 4 >= announced + chunk_floats or got == raw.size):
                    stop = min(announced + chunk_floats, out.size)
                    arrived(announced, stop)
                    announced = stop
        finally:
            resp.close()
        if got != raw.size:
            raise TimeoutError(f"step {step} attempt {attempt}: the total stopped after {got} of {raw.size} bytes")

    def put_state(self, step: int, blob: bytes) -> str:
        url = f"{self.base}/states/{step}"
        return _status(self.request("PUT", url, params={"peer_id": self.peer_id}, content=blob))

    def latest_state(self, limit: int = MAX_STATE_BYTES) -> tuple[int, bytes]:
        """The newest state's step and bytes (at most `limit`)."""
        headers, blob = self.server.exchange("GET", f"{self.base}/states/latest", limit=limit)
        step = headers.get("X-Crowdtrain-Step", "")
        if not step.isdigit():
            raise BadReply(f"the state's reply names no step (X-Crowdtrain-Step: {step[:20]!r})")
        return int(step), blob


def _status(reply: bytes) -> str:
    """The `status` of an outcome reply ({"status": ...}); BadReply if it has none."""
    try:
        status = json.loads(reply)["status"]
    except (ValueError, KeyError, TypeError):
        status = None
    if not isinstance(status, str):
        raise BadReply(f"the reply names no status: {reply[:100]!r}")
    return status[:100]


def b64(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()
