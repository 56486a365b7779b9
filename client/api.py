"""The scheduler's HTTP API as the client sees it, with retries while the server is unreachable."""

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tenacity import RetryCallState, retry, retry_if_exception, wait_random_exponential
from tenacity.stop import stop_base

from crowdtrain.schemas import (AssignmentOut, HeartbeatReply, HostRegister, HostRegistered, Resources, ResultMetrics,
                                WorkReply, WorkRequest)

log = logging.getLogger(__name__)


class Refused(Exception):
    """The server answered 4xx: retrying the same request will not help."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Stopping(Exception):
    """The client is shutting down; the request was not made."""


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500


class _StopWhenSet(stop_base):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.event.is_set()


def _log_retry(state: RetryCallState) -> None:
    log.warning("server unreachable (%s); retry %d in %.1fs", state.outcome.exception(), state.attempt_number,
                state.next_action.sleep if state.next_action else 0)


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
    def __init__(self, server_url: str, stop: threading.Event, timeout: float = 60.0,
                 max_download_rate: float | None = None, max_upload_rate: float | None = None):
        self.stop = stop
        self.http = httpx.Client(base_url=server_url.rstrip("/"), timeout=timeout)
        self.token: str | None = None
        self.downloads = Throttle(max_download_rate)
        self.uploads = Throttle(max_upload_rate)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        headers = {**kwargs.pop("headers", {}), **({"Authorization": f"Bearer {self.token}"} if self.token else {})}

        content = kwargs.pop("content", None)

        @retry(retry=retry_if_exception(_transient), wait=wait_random_exponential(multiplier=0.5, max=30),
               stop=_StopWhenSet(self.stop), before_sleep=_log_retry, reraise=True)
        def attempt() -> httpx.Response:
            # A body given as a function is produced anew for each attempt (a generator is used up).
            body = content() if callable(content) else content
            resp = self.http.request(method, url, headers=headers, content=body, **kwargs)
            if resp.status_code >= 500:
                resp.raise_for_status()
            if resp.status_code >= 400:
                try:
                    detail = resp.json().get("detail", resp.text)
                except ValueError:
                    detail = resp.text
                raise Refused(resp.status_code, detail if isinstance(detail, str) else json.dumps(detail))
            return resp

        return attempt()

    def register(self, join_token: str, name: str, resources: Resources) -> HostRegistered:
        body = HostRegister(join_token=join_token, name=name, resources=resources)
        return HostRegistered.model_validate(self._request("POST", "/v1/hosts", json=body.model_dump()).json())

    def request_work(self, free_slots: int, cached: list[str], resources: Resources) -> WorkReply:
        body = WorkRequest(free_slots=free_slots, cached_shards=cached, resources=resources)
        return WorkReply.model_validate(self._request("POST", "/v1/work", json=body.model_dump()).json())

    def heartbeat(self, assignment_id: int) -> HeartbeatReply:
        return HeartbeatReply.model_validate(
            self._request("POST", f"/v1/assignments/{assignment_id}/heartbeat").json())

    def upload(self, a: AssignmentOut, blob: bytes, metrics: ResultMetrics) -> None:
        params = {k: v for k, v in metrics.model_dump().items() if v is not None}
        def body():
            for start in range(0, len(blob), UPLOAD_CHUNK):
                chunk = blob[start:start + UPLOAD_CHUNK]
                self.uploads.consume(len(chunk))
                yield chunk

        self._request("PUT", f"/v1/assignments/{a.assignment_id}/result", params=params,
                      content=body if self.uploads.rate else blob,
                      headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(blob))})

    def abandon(self, assignment_id: int) -> None:
        self.http.post(f"/v1/assignments/{assignment_id}/abandon",
                       headers={"Authorization": f"Bearer {self.token}"}, timeout=5.0)

    def report_error(self, assignment_id: int, message: str) -> None:
        self._request("POST", f"/v1/assignments/{assignment_id}/error", json={"message": message[:1000]})

    def download(self, url: str, dest: Path) -> None:
        """Stream a file to `dest`; `url` is absolute (presigned) or relative to the server."""

        @retry(retry=retry_if_exception(_transient), wait=wait_random_exponential(multiplier=0.5, max=30),
               stop=_StopWhenSet(self.stop), before_sleep=_log_retry, reraise=True)
        def attempt() -> None:
            headers = {"Authorization": f"Bearer {self.token}"} if url.startswith("/") else {}
            with self.http.stream("GET", url, headers=headers) as resp:
                if resp.status_code >= 500:
                    resp.raise_for_status()
                if resp.status_code >= 400:
                    resp.read()
                    raise Refused(resp.status_code, resp.text)
                with dest.open("wb") as f:
                    for chunk in resp.iter_bytes(1 << 18):
                        self.downloads.consume(len(chunk))
                        f.write(chunk)

        attempt()
