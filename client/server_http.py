"""The scheduler's HTTP layer as every client part calls it (the volunteer client's work loop and the
DeDLOC peer): one origin, bounded replies, retries of what may succeed later.

Replies are untrusted: a request goes only to the scheduler's origin (an absolute URL elsewhere is
ForbiddenURL, see crowdtrain.client.origins), a redirect is refused and never followed, a reply is
read up to a bound (MAX_REPLY_BYTES unless the caller names one) and must fit its schema
(`parse_reply`), or it is refused as a whole (BadReply). A 4xx answer is Refused; 5xx, 429 and
transport errors are retried with random exponential waits until the caller stops or its attempts
are spent.
"""

import json
import logging
import threading
from collections.abc import Iterable
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from tenacity import RetryCallState, retry, retry_if_exception, stop_after_attempt, wait_random_exponential
from tenacity.stop import stop_base

from crowdtrain.client.origins import Origins, check_url_text

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 32 * 2**20  # a work reply of 256 assignments with Keras JSON recipes fits well


class BadReply(Exception):
    """The server's answer is unusable (too large, not JSON, not its schema, a redirect): refused as a whole.

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


def parse_reply(model: type[M], body: bytes) -> M:
    """The reply as `model`; BadReply naming the first field that does not fit."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise BadReply(f"{model.__name__} refused: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_input=False)[0]
    where = ".".join(str(part) for part in err["loc"])
    return f"{where}: {err['msg']}" + (f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else "")


def transient(exc: BaseException) -> bool:
    """Worth retrying: the server was unreachable, failed (5xx) or throttles our address (429)."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, Refused):  # our address is throttled (someone there guessed tokens): wait it out
        return exc.status == 429
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500


class StopWhenSet(stop_base):
    def __init__(self, *events: threading.Event | None):
        self.events = [e for e in events if e is not None]

    def __call__(self, retry_state: RetryCallState) -> bool:
        return any(e.is_set() for e in self.events)


def log_retry(state: RetryCallState) -> None:
    if state.outcome is None:  # tenacity calls before_sleep only after an attempt has ended
        raise RuntimeError("retry logged before the attempt ended: it has no outcome")
    log.warning(
        "server unreachable (%s); retry %d in %.1fs",
        state.outcome.exception(),
        state.attempt_number,
        state.next_action.sleep if state.next_action else 0,
    )


def detail(body: bytes) -> str:
    """The message of an error reply: FastAPI's `detail`, else the text, cut short."""
    text = body.decode("utf-8", errors="replace")
    try:
        found = json.loads(text).get("detail", text)
    except (ValueError, AttributeError):
        found = text
    return (found if isinstance(found, str) else json.dumps(found))[:1000]


UNTIL_STOPPED = 0  # `attempts` of one request that is retried until the client stops, whatever the layer's


class ServerHTTP:
    """Requests to one scheduler (see the module docstring). `stop` ends every retry (the client shuts
    down); `attempts` bounds each request's tries (None: until stopped); waits between tries are
    random, exponential from `first_wait`, at most `max_wait` seconds; requests leave from
    `local_address` when one is given."""

    def __init__(
        self,
        server_url: str,
        timeout: float,
        stop: threading.Event | None = None,
        attempts: int | None = None,
        first_wait: float = 0.5,
        max_wait: float = 30.0,
        local_address: str | None = None,
    ):
        # Bound to `local_address` when given: the scheduler counts the networks hosts call from.
        transport = httpx.HTTPTransport(local_address=local_address) if local_address else None
        # An httpx client follows no redirect unless told to.
        self.http = httpx.Client(base_url=server_url.rstrip("/"), timeout=timeout, transport=transport)
        self.scheduler = Origins.for_scheduler(server_url)
        self.stop = stop if stop is not None else threading.Event()
        self.attempts = attempts
        self.first_wait, self.max_wait = first_wait, max_wait

    def close(self) -> None:
        self.http.close()

    def build(self, method: str, url: str, **kwargs: Any) -> httpx.Request:
        """The request, once its URL is checked to be the scheduler's (ForbiddenURL otherwise)."""
        check_url_text(url)
        req = self.http.build_request(method, url, **kwargs)
        self.scheduler.check(req.url)
        return req

    def exchange(
        self,
        method: str,
        url: str,
        give_up: threading.Event | None = None,
        attempts: int | None = None,
        limit: int | None = None,
        **kwargs: Any,
    ) -> tuple[httpx.Headers, bytes]:
        """The reply's headers and body (at most `limit`, default MAX_REPLY_BYTES); Refused on 4xx,
        BadReply on a redirect; retried on 5xx, 429 and transport errors until the client stops,
        `give_up` is set or `attempts` (default the layer's; UNTIL_STOPPED: no bound) are spent. A
        `content` given as a function is produced anew for each attempt (a generator is used up)."""
        content = kwargs.pop("content", None)
        tries = None if attempts == UNTIL_STOPPED else attempts if attempts is not None else self.attempts
        stop = StopWhenSet(self.stop, give_up)

        @retry(
            retry=retry_if_exception(transient),
            wait=wait_random_exponential(multiplier=self.first_wait, max=self.max_wait),
            stop=stop if tries is None else stop | stop_after_attempt(tries),
            before_sleep=log_retry,
            reraise=True,
        )
        def attempt() -> tuple[httpx.Headers, bytes]:
            body = content() if callable(content) else content
            resp = self.http.send(self.build(method, url, content=body, **kwargs), stream=True)
            try:
                if resp.status_code >= 500:
                    resp.raise_for_status()
                if 300 <= resp.status_code < 400:
                    raise BadReply(_redirect(resp, method, url))
                reply = read_at_most(resp, MAX_REPLY_BYTES if limit is None else limit, f"reply to {method} {url}")
            finally:
                resp.close()
            if resp.status_code >= 400:
                raise Refused(resp.status_code, detail(reply), f"{method} {url}")
            return resp.headers, reply

        return attempt()

    def request(self, method: str, url: str, give_up: threading.Event | None = None, **kwargs: Any) -> bytes:
        """The reply's body, as `exchange`."""
        return self.exchange(method, url, give_up, **kwargs)[1]


def _redirect(resp: httpx.Response, method: str, url: str) -> str:
    location = resp.headers.get("Location", "")[:200]
    return f"the scheduler answered {method} {url} with {resp.status_code} to {location!r}: redirects are not followed"
