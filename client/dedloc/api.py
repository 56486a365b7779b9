"""The scheduler's `/v1/dedloc` API as a peer sees it: short retries on transport errors only."""

import base64
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import numpy as np

from crowdtrain.core.schemas import HostRegistered
from crowdtrain.core.schemas_dedloc import PeerJoined, PeerRefusal, Progress, ProgressReply, StoreOp, StoreReply


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class PeerAPI:
    def __init__(self, server: str, timeout: float = 120.0):
        self.http = httpx.Client(base_url=server.rstrip("/"), timeout=timeout)
        self.job_id: int | None = None
        self.peer_id = ""

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, url: str, attempts: int = 5, **kw: Any) -> httpx.Response:
        for attempt in range(attempts):
            try:
                resp = self.http.request(method, url, **kw)
            except httpx.TransportError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.2 * 2**attempt)
                continue
            if resp.status_code >= 500 and attempt < attempts - 1:
                time.sleep(0.2 * 2**attempt)
                continue
            if resp.status_code >= 400:
                try:
                    detail = resp.json().get("detail", resp.text)
                except ValueError:
                    detail = resp.text
                raise Refused(resp.status_code, str(detail))
            return resp
        raise AssertionError("unreachable")

    def register(self, join_token: str, name: str) -> HostRegistered:
        """Register a host and use its token from now on."""
        body = {"join_token": join_token, "name": name}
        registered = HostRegistered.model_validate(self.request("POST", "/v1/hosts", json=body).json())
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
                joined = PeerJoined.model_validate(
                    self.request("POST", f"{self.base}/join", json={"relayed": relayed}).json()
                )
                self.peer_id = joined.peer_id
                return joined
            except Refused as exc:
                if exc.status != 409 or "being prepared" not in str(exc):
                    raise
                time.sleep(0.5)
        raise TimeoutError(f"job {job_id} was never ready")

    def shard(self, shard_id: int) -> bytes:
        return self.request("GET", f"/v1/shards/{shard_id}").content

    def progress(self, step: int, examples: int, attempt: int | None, params_digest: str | None) -> ProgressReply:
        body = Progress(
            peer_id=self.peer_id, step=step, examples=examples, attempt=attempt, params_digest=params_digest
        )
        return ProgressReply.model_validate(
            self.request("POST", f"{self.base}/progress", json=body.model_dump()).json()
        )

    def report(self, step: int, attempt: int, ok: bool, result_digest: str = "", message: str = "") -> str:
        resp = self.request(
            "POST",
            f"{self.base}/rounds/{step}/{attempt}/report",
            json={"peer_id": self.peer_id, "ok": ok, "result_digest": result_digest, "message": message[:1000]},
        )
        return resp.json()["status"]

    def store(self, step: int, attempt: int, op: str, **fields: Any) -> StoreReply:
        body = StoreOp(peer_id=self.peer_id, **fields)
        return StoreReply.model_validate(
            self.request("POST", f"{self.base}/rounds/{step}/{attempt}/store/{op}", json=body.model_dump()).json()
        )

    def put_part(self, step: int, attempt: int, part: str, size: int, chunks: Iterable[bytes]) -> str:
        """Stream a part of `size` float32 (raw little-endian) as `chunks` come; sent once (a stream
        cannot be replayed: a failure fails the round)."""
        resp = self.request(
            "PUT",
            f"{self.base}/rounds/{step}/{attempt}/parts/{part}",
            attempts=1,
            params={"peer_id": self.peer_id, "size": size},
            content=chunks,
        )
        return resp.json()["status"]

    def total_into(
        self, step: int, attempt: int, out: np.ndarray, chunk_floats: int, arrived: Callable[[int, int], None]
    ) -> None:
        """Read the round's total into `out` (float32) as the scheduler sums it, calling
        `arrived(start, stop)` for each chunk of `chunk_floats` floats once it is all in `out`."""
        raw = out.view(np.uint8)
        got, announced = 0, 0
        url = f"{self.base}/rounds/{step}/{attempt}/total"
        with self.http.stream("GET", url, params={"peer_id": self.peer_id, "size": out.size}) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise Refused(resp.status_code, resp.text)
            for piece in resp.iter_raw():
                if got + len(piece) > raw.size:
                    raise ValueError(f"step {step} attempt {attempt}: the total is longer than {out.size} floats")
                raw[got : got + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
                got += len(piece)
                while announced < out.size and (got // 4 >= announced + chunk_floats or got == raw.size):
                    stop = min(announced + chunk_floats, out.size)
                    arrived(announced, stop)
                    announced = stop
        if got != raw.size:
            raise TimeoutError(f"step {step} attempt {attempt}: the total stopped after {got} of {raw.size} bytes")

    def put_state(self, step: int, blob: bytes) -> str:
        return self.request("PUT", f"{self.base}/states/{step}", params={"peer_id": self.peer_id}, content=blob).json()[
            "status"
        ]

    def latest_state(self) -> tuple[int, bytes]:
        resp = self.request("GET", f"{self.base}/states/latest")
        return int(resp.headers["X-Crowdtrain-Step"]), resp.content


def b64(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()
