"""The scheduler's HTTP API as the client sees it, with retries while the server is unreachable.

Replies are untrusted: a reply comes through crowdtrain.client.server_http (the scheduler's origin
only, read up to MAX_REPLY_BYTES, no redirect) and must fit its schema, or it is refused as a whole
(BadReply); a download comes only from an allowed origin (see crowdtrain.client.origins) and stops
at the size the assignment declared.
"""

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from tenacity import retry, retry_if_exception, wait_random_exponential

from crowdtrain.client.origins import Origins, check_url_text
from crowdtrain.client.server_http import (
    MAX_REPLY_BYTES,
    BadReply,
    Refused,
    ServerHTTP,
    Stopping,
    StopWhenSet,
    TooLarge,
    detail,
    log_retry,
    parse_reply,
    read_at_most,
    transient,
)
from crowdtrain.core.schemas import (
    AssignmentOut,
    HeartbeatReply,
    HostRegister,
    HostRegistered,
    Resources,
    ResultMetrics,
    SnapshotBound,
    WorkReply,
    WorkRequest,
)
from crowdtrain.core.schemas_experts import CallReport, CallsRecorded, RoutingTable

log = logging.getLogger(__name__)

__all__ = ["MAX_REPLY_BYTES", "BadReply", "Refused", "SchedulerAPI", "Stopping", "TooLarge", "read_at_most"]
MAX_ASSIGNMENTS_NAMED = 256


def _assignment_ids(body: bytes) -> list[int]:
    """The assignment ids a work reply names, read leniently (the reply itself was refused)."""
    try:
        items = json.loads(body).get("assignments", [])
        ids = [a.get("assignment_id") for a in items[:MAX_ASSIGNMENTS_NAMED] if isinstance(a, dict)]
    except (ValueError, AttributeError, TypeError):
        return []
    return [i for i in ids if type(i) is int]


class Throttle:
    """Caps a transfer direction at `rate` bytes/s on average, across every thread that uses it."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def consume(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + n / self.rate
            wait = self._free_at - now - n / self.rate  # this chunk may go now if the line was free
        if wait > 0:
            time.sleep(wait)


UPLOAD_CHUNK = 256 * 1024


class SchedulerAPI:
    def __init__(
        self,
        server_url: str,
        stop: threading.Event,
        timeout: float = 60.0,
        max_download_rate: float | None = None,
        max_upload_rate: float | None = None,
        origins: Origins | None = None,
        local_address: str | None = None,
    ):
        self.stop = stop
        self.server = ServerHTTP(server_url, timeout, stop, local_address=local_address)
        self.http = self.server.http
        self.origins = origins or Origins.for_scheduler(server_url)
        self.token: str | None = None
        self.downloads = Throttle(max_download_rate)
        self.uploads = Throttle(max_upload_rate)

    def close(self) -> None:
        self.server.close()

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _request(self, method: str, url: str, give_up: threading.Event | None = None, **kwargs: Any) -> bytes:
        """The reply's body (crowdtrain.client.server_http: at most MAX_REPLY_BYTES, Refused on 4xx),
        retried on 5xx and transport errors until the client stops or `give_up` is set."""
        headers = {**kwargs.pop("headers", {}), **self._auth()}
        return self.server.request(method, url, give_up, headers=headers, **kwargs)

    def register(self, join_token: str, name: str, resources: Resources, account: str = "") -> HostRegistered:
        body = HostRegister(join_token=join_token, name=name, resources=resources, account=account)
        return parse_reply(HostRegistered, self._request("POST", "/v1/hosts", json=body.model_dump()))

    def request_work(
        self,
        free_slots: int,
        cached: list[str],
        resources: Resources,
        refused_jobs: list[int] | None = None,
        give_up: threading.Event | None = None,
    ) -> WorkReply:
        """The assignments the server hands out, of jobs not among `refused_jobs`; BadReply (with their
        ids) if any one is unusable.

        Retries stop when `give_up` is set (the client takes no more work: no use waiting for the server).
        """
        body = WorkRequest(
            free_slots=free_slots, cached_shards=cached, resources=resources, refused_jobs=refused_jobs or []
        )
        reply = self._request("POST", "/v1/work", give_up, json=body.model_dump())
        try:
            return parse_reply(WorkReply, reply)
        except BadReply as exc:
            raise BadReply(str(exc), _assignment_ids(reply)) from None

    def heartbeat(self, assignment_id: int) -> HeartbeatReply:
        return parse_reply(HeartbeatReply, self._request("POST", f"/v1/assignments/{assignment_id}/heartbeat"))

    def start(self, assignment_id: int) -> SnapshotBound:
        """Which snapshot the assignment trains from, now that a compute slot starts it."""
        return parse_reply(SnapshotBound, self._request("POST", f"/v1/assignments/{assignment_id}/start"))

    def routing(self, mixture_id: int, since: int) -> RoutingTable:
        """What changed in the routing table of a mixture-of-experts job's experts since version `since`."""
        return parse_reply(RoutingTable, self._request("GET", f"/v1/mixtures/{mixture_id}/routing?since={since}"))

    def report_calls(self, mixture_id: int, report: CallReport) -> CallsRecorded:
        """Report a moe workunit's calls to the mixture's experts (their hosts' credit and charges)."""
        body = report.model_dump(mode="json")
        return parse_reply(CallsRecorded, self._request("POST", f"/v1/mixtures/{mixture_id}/calls", json=body))

    def upload(self, a: AssignmentOut, blob: bytes, metrics: ResultMetrics) -> None:
        params = {k: v for k, v in metrics.model_dump().items() if v is not None}

        def body():
            for start in range(0, len(blob), UPLOAD_CHUNK):
                chunk = blob[start : start + UPLOAD_CHUNK]
                self.uploads.consume(len(chunk))
                yield chunk

        self._request(
            "PUT",
            f"/v1/assignments/{a.assignment_id}/result",
            params=params,
            content=body if self.uploads.rate else blob,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(blob))},
        )

    def abandon(self, assignment_id: int) -> None:
        self.http.post(f"/v1/assignments/{assignment_id}/abandon", headers=self._auth(), timeout=5.0)

    def report_error(self, assignment_id: int, message: str) -> None:
        self._request("POST", f"/v1/assignments/{assignment_id}/error", json={"message": message[:1000]})

    def download(self, url: str, dest: Path, max_bytes: int) -> None:
        """Stream a file of at most `max_bytes` to `dest`.

        `url` is relative to the scheduler or absolute (presigned); it is fetched only from an
        allowed origin (ForbiddenURL otherwise), the host token is sent only to the scheduler, and
        redirects are not followed.
        """
        check_url_text(url)
        req = self.http.build_request("GET", url)
        if self.origins.check(req.url) == self.origins.scheduler:
            req.headers.update(self._auth())

        @retry(
            retry=retry_if_exception(transient),
            wait=wait_random_exponential(multiplier=0.5, max=30),
            stop=StopWhenSet(self.stop),
            before_sleep=log_retry,
            reraise=True,
        )
        def attempt() -> None:
            resp = self.http.send(req, stream=True)
            try:
                if resp.status_code >= 500:
                    resp.raise_for_status()
                if resp.status_code != 200:
                    reply = detail(read_at_most(resp, 64 * 1024, "error reply"))
                    raise Refused(resp.status_code, reply, f"download of {req.url.copy_with(query=None)}")
                declared = resp.headers.get("Content-Length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise TooLarge(f"download of {declared} bytes is larger than the {max_bytes} bytes announced")
                received = 0
                with dest.open("wb") as f:
                    for chunk in resp.iter_bytes(1 << 18):
                        received += len(chunk)
                        if received > max_bytes:
                            raise TooLarge(f"download is larger than the {max_bytes} bytes announced")
                        self.downloads.consume(len(chunk))
                        f.write(chunk)
            finally:
                resp.close()

        attempt()
