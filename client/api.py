"""The scheduler's HTTP API as the client sees it, with retries while the server is unreachable.

Replies are untrusted: a reply is read up to MAX_REPLY_BYTES and must fit its schema, or it is
refused as a whole (BadReply); a download comes only from an allowed origin (see crowdtrain.client.origins)
and stops at the size the assignment declared.
"""

import json
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from tenacity import RetryCallState, retry, retry_if_exception, wait_random_exponential
from tenacity.stop import stop_base

from crowdtrain.client.origins import Origins, check_url_text
from crowdtrain.core.schemas import (
    AssignmentOut,
    HeartbeatReply,
    HostRegister,
    HostRegistered,
    Resources,
    ResultMetrics,
    WorkReply,
    WorkRequest,
)

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 32 * 2**20  # a work reply of 256 assignments with Keras JSON recipes fits well
MAX_ASSIGNMENTS_NAMED = 256


class BadReply(Exception):
    """The server's answer is unusable (too large, not JSON, not its schema): refused as a whole.

    `assignment_ids` names the assignments a refused work reply carried, so that the client can
    hand them back at once instead of leaving them to time out.
    """

    def __init__(self, message: str, assignment_ids: Iterable[int] = ()):
        super().__init__(message)
        self.assignment_ids = list(assignment_ids)


class Refused(Exception):
    """The server answered 4xx: retrying the same request will not help. `request` says which one
    ("PUT /v1/assignments/41/result", "download of /v1/files/...")."""

    def __init__(self, status: int, message: str, request: str = ""):
        super().__init__(f"{request + ': ' if request else ''}HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.request = request


class Stopping(Exception):
    """The client is shutting down; the request was not made."""


class TooLarge(BadReply):
    """A reply or download longer than the client accepts."""


def read_at_most(resp: httpx.Response, limit: int, what: str) -> bytes:
    """The (decoded) body of a streamed response; TooLarge as soon as it passes `limit` bytes."""
    declared = resp.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"{what} of {declared} bytes is larger than {limit} bytes")
    body = bytearray()
    for chunk in resp.iter_bytes():
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"{what} is larger than {limit} bytes")
    return bytes(body)


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise BadReply(f"{model.__name__} refused: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_input=False)[0]
    where = ".".join(str(part) for part in err["loc"])
    return f"{where}: {err['msg']}" + (f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else "")


def _assignment_ids(body: bytes) -> list[int]:
    """The assignment ids a work reply names, read leniently (the reply itself was refused)."""
    try:
        items = json.loads(body).get("assignments", [])
        ids = [a.get("assignment_id") for a in items[:MAX_ASSIGNMENTS_NAMED] if isinstance(a, dict)]
    except (ValueError, AttributeError, TypeError):
        return []
    return [i for i in ids if type(i) is int]


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, Refused):  # our address is throttled (someone there guessed tokens): wait it out
        return exc.status == 429
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500


class _StopWhenSet(stop_base):
    def __init__(self, *events: threading.Event | None):
        self.events = [e for e in events if e is not None]

    def __call__(self, retry_state: RetryCallState) -> bool:
        return any(e.is_set() for e in self.events)


def _log_retry(state: RetryCallState) -> None:
    if state.outcome is None:  # tenacity calls before_sleep only after an attempt has ended
        raise RuntimeError("retry logged before the attempt ended: it has no outcome")
    log.warning(
        "server unreachable (%s); retry %d in %.1fs",
        state.outcome.exception(),
        state.attempt_number,
        state.next_action.sleep if state.next_action else 0,
    )


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
        # Bound to `local_address` when given: the scheduler counts the networks hosts call from.
        transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
        self.http = httpx.Client(base_url=server_url.rstrip("/"), timeout=timeout, transport=transport)
        self.origins = origins or Origins.for_scheduler(server_url)
        self.token: str | None = None
        self.downloads = Throttle(max_download_rate)
        self.uploads = Throttle(max_upload_rate)

    def close(self) -> None:
        self.http.close()

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _request(self, method: str, url: str, give_up: threading.Event | None = None, **kwargs: Any) -> bytes:
        """The reply's body (at most MAX_REPLY_BYTES); Refused on 4xx, retried on 5xx and transport errors
        until the client stops or `give_up` is set."""
        headers = {**kwargs.pop("headers", {}), **self._auth()}

        content = kwargs.pop("content", None)

        @retry(
            retry=retry_if_exception(_transient),
            wait=wait_random_exponential(multiplier=0.5, max=30),
            stop=_StopWhenSet(self.stop, give_up),
            before_sleep=_log_retry,
            reraise=True,
        )
        def attempt() -> bytes:
            # A body given as a function is produced anew for each attempt (a generator is used up).
            body = content() if callable(content) else content
            req = self.http.build_request(method, url, headers=headers, content=body, **kwargs)
            resp = self.http.send(req, stream=True)
            try:
                if resp.status_code >= 500:
                    resp.raise_for_status()
                reply = read_at_most(resp, MAX_REPLY_BYTES, f"reply to {method} {url}")
            finally:
                resp.close()
            if resp.status_code >= 400:
                raise Refused(resp.status_code, _detail(reply), f"{method} {url}")
            return reply

        return attempt()

    def register(self, join_token: str, name: str, resources: Resources, account: str = "") -> HostRegistered:
        body = HostRegister(join_token=join_token, name=name, resources=resources, account=account)
        return _parse(HostRegistered, self._request("POST", "/v1/hosts", json=body.model_dump()))

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
            return _parse(WorkReply, reply)
        except BadReply as exc:
            raise BadReply(str(exc), _assignment_ids(reply)) from None

    def heartbeat(self, assignment_id: int) -> HeartbeatReply:
        return _parse(HeartbeatReply, self._request("POST", f"/v1/assignments/{assignment_id}/heartbeat"))

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
            retry=retry_if_exception(_transient),
            wait=wait_random_exponential(multiplier=0.5, max=30),
            stop=_StopWhenSet(self.stop),
            before_sleep=_log_retry,
            reraise=True,
        )
        def attempt() -> None:
            resp = self.http.send(req, stream=True)
            try:
                if resp.status_code >= 500:
                    resp.raise_for_status()
                if resp.status_code != 200:
                    detail = _detail(read_at_most(resp, 64 * 1024, "error reply"))
                    raise Refused(resp.status_code, detail, f"download of {req.url.copy_with(query=None)}")
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


def _detail(body: bytes) -> str:
    """The message of an error reply: FastAPI's `detail`, else the text, cut short."""
    text = body.decode("utf-8", errors="replace")
    try:
        detail = json.loads(text).get("detail", text)
    except (ValueError, AttributeError):
        detail = text
    return (detail if isinstance(detail, str) else json.dumps(detail))[:1000]
