"""Simulated hosts: many registered clients in one process that ask for work and upload results
without training. A load generator for the scheduler and the parameter servers.

With `train_seconds`, each host holds each workunit that long before it uploads, sending the
heartbeats a real client sends meanwhile (every `heartbeat_interval` the work reply names), so a
run at a given number of hosts and workunit time loads the servers as real volunteers would.

Each host returns the snapshot it was given, one weight moved (`result_of`), as its "trained"
parameters: a valid result of the right names, shapes and dtypes, so every upload goes through the
whole validate-and-merge path.
"""

import asyncio
import signal
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from crowdtrain.core.tensors import decode, encode


def result_of(snapshot: bytes, assignment_id: int) -> bytes:
    """A simulated host's result: the snapshot it was sent, with one weight moved by an amount of its own.
    Returning the snapshot unchanged would be a lazy host's result, and the same weights twice a replay,
    which the parameter servers refuse (crowdtrain.assimilator.merge)."""
    params = decode(snapshot)
    name = next(k for k in sorted(params) if params[k].dtype.kind == "f" and params[k].size)
    moved = params[name].copy()
    moved.flat[0] += np.float32(1e-3 * (1 + assignment_id % 1000))
    return encode({**params, name: moved})


@dataclass
class SimulationStats:
    hosts: int
    requests: int = 0
    work_latencies: list[float] = field(default_factory=list)
    dispatched: int = 0
    uploads: int = 0
    heartbeats: int = 0
    refused: int = 0
    server_errors: int = 0  # 5xx answers, but for backpressure
    busy: int = 0  # uploads answered 503 with Retry-After (the upload slots were full), then sent again
    transport_errors: dict[str, int] = field(default_factory=dict)  # dropped connections and the like
    seconds: float = 0.0

    def summary(self) -> dict:
        lat = np.array(self.work_latencies or [0.0]) * 1000
        return {
            "hosts": self.hosts,
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "requests_per_s": round(self.requests / self.seconds, 1) if self.seconds else 0.0,
            "work_requests": len(self.work_latencies),
            "work_p50_ms": round(float(np.percentile(lat, 50)), 1),
            "work_p95_ms": round(float(np.percentile(lat, 95)), 1),
            "dispatched": self.dispatched,
            "uploads": self.uploads,
            "heartbeats": self.heartbeats,
            "refused": self.refused,
            "server_errors": self.server_errors,
            "busy": self.busy,
            "transport_errors": self.transport_errors,
        }


class _Simulation:
    def __init__(
        self,
        server: str,
        join_token: str,
        hosts: int,
        duration: float,
        until_idle: float | None,
        train_seconds: float = 0.0,
    ):
        self.server, self.join_token, self.duration, self.until_idle = server, join_token, duration, until_idle
        self.train_seconds = train_seconds
        self.stats = SimulationStats(hosts)
        self.snapshots: dict[str, bytes] = {}
        self.last_dispatch = time.monotonic()
        self.deadline = 0.0
        self.stopped = False

    def done(self) -> bool:
        now = time.monotonic()
        return (
            self.stopped
            or now > self.deadline
            or (self.until_idle is not None and now - self.last_dispatch > self.until_idle)
        )

    async def request(self, http: httpx.AsyncClient, method: str, url: str, **kw) -> httpx.Response:
        self.stats.requests += 1
        return await http.request(method, url, **kw)

    async def register(self, http: httpx.AsyncClient, i: int) -> dict:
        resp = await self.request(http, "POST", "/v1/hosts", json={"join_token": self.join_token, "name": f"sim-{i}"})
        resp.raise_for_status()
        return {"Authorization": f"Bearer {resp.json()['host_token']}"}

    async def snapshot(self, http: httpx.AsyncClient, ref: dict, auth: dict) -> bytes:
        if ref["sha256"] not in self.snapshots:
            # Presigned object-storage URLs carry their own credentials.
            resp = await self.request(http, "GET", ref["url"], headers=auth if ref["url"].startswith("/") else {})
            resp.raise_for_status()
            self.snapshots[ref["sha256"]] = resp.content
        return self.snapshots[ref["sha256"]]

    async def host(self, http: httpx.AsyncClient, auth: dict) -> None:
        while not self.done():
            try:
                start = time.perf_counter()
                resp = await self.request(http, "POST", "/v1/work", json={"free_slots": 1}, headers=auth)
                self.stats.work_latencies.append(time.perf_counter() - start)
                if resp.status_code >= 500:
                    self.stats.server_errors += 1
                    await asyncio.sleep(0.5)
                    continue
                resp.raise_for_status()
                reply = resp.json()
                if not reply["assignments"]:
                    await asyncio.sleep(min(reply["retry_after"], 1.0))
                    continue
                self.last_dispatch = time.monotonic()
                for a in reply["assignments"]:
                    self.stats.dispatched += 1
                    body = result_of(await self.snapshot(http, a["snapshot"], auth), a["assignment_id"])
                    if not await self.train(http, a["assignment_id"], float(reply["heartbeat_interval"]), auth):
                        continue
                    up = await self.upload(http, a["assignment_id"], body, auth)
                    if up.status_code == 202:
                        self.stats.uploads += 1
                    elif up.status_code >= 500:
                        self.stats.server_errors += 1
                    else:
                        self.stats.refused += 1
            except httpx.HTTPStatusError as exc:
                self.stats.refused += 1
                name = f"HTTP {exc.response.status_code}"
                self.stats.transport_errors[name] = self.stats.transport_errors.get(name, 0) + 1
            except httpx.TransportError as exc:
                # A real client retries these (client/api.py); the simulated host just asks again.
                name = type(exc).__name__
                self.stats.transport_errors[name] = self.stats.transport_errors.get(name, 0) + 1
                await asyncio.sleep(0.5)

    async def train(self, http: httpx.AsyncClient, assignment_id: int, heartbeat_every: float, auth: dict) -> bool:
        """Hold the workunit `train_seconds`, heartbeating as a client does; False when the scheduler
        no longer wants it (or the run ended), so that it is not uploaded."""
        ends = time.monotonic() + self.train_seconds
        while (left := ends - time.monotonic()) > 0:
            await asyncio.sleep(min(left, heartbeat_every))
            if self.done():
                return False
            if time.monotonic() < ends:
                beat = await self.request(http, "POST", f"/v1/assignments/{assignment_id}/heartbeat", headers=auth)
                self.stats.heartbeats += 1
                if beat.status_code != 200 or not beat.json()["keep_going"]:
                    return False
        return True

    async def upload(self, http: httpx.AsyncClient, assignment_id: int, body: bytes, auth: dict) -> httpx.Response:
        """Upload a result. A 503 with Retry-After is the scheduler's backpressure (its upload slots are
        full), not a failure: wait as it says and send again (the real client retries it with backoff too)."""
        while True:
            up = await self.request(http, "PUT", f"/v1/assignments/{assignment_id}/result", content=body, headers=auth)
            if up.status_code != 503 or "retry-after" not in up.headers or self.stopped:
                return up
            self.stats.busy += 1
            await asyncio.sleep(float(up.headers["retry-after"]))

    def stop(self) -> None:
        """End the run early: each host finishes the request or upload it is in, then stops."""
        self.stopped = True

    async def run(self, connections: int) -> SimulationStats:
        # SIGTERM or Ctrl-C ends the run as its duration would: the figures so far are still reported.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        async with httpx.AsyncClient(base_url=self.server, limits=limits, timeout=300) as http:
            auths = await asyncio.gather(*(self.register(http, i) for i in range(self.stats.hosts)))
            start = time.monotonic()
            self.deadline = start + self.duration
            self.last_dispatch = start
            self.stats.requests = 0  # count the load, not the registrations
            await asyncio.gather(*(self.host(http, auth) for auth in auths))
            self.stats.seconds = time.monotonic() - start
        return self.stats


def simulate(
    server: str,
    join_token: str,
    hosts: int,
    duration: float,
    until_idle: float | None = None,
    connections: int = 100,
    train_seconds: float = 0.0,
) -> SimulationStats:
    """Run `hosts` simulated hosts for `duration` seconds (or until no work was handed out for `until_idle`,
    or until SIGTERM or SIGINT), each holding a workunit `train_seconds` before it uploads."""
    return asyncio.run(_Simulation(server, join_token, hosts, duration, until_idle, train_seconds).run(connections))
