"""Spot-interruption notices: poll the cloud's metadata service and decide what to do with running work.

On AWS the notice appears at `/latest/meta-data/spot/instance-action` (IMDSv2: a session token
from PUT `/latest/api/token` first) about two minutes before the instance is reclaimed; until
then the path answers 404. SIGTERM is handled the same way with a notice that expires at once.

What to do is a pure decision (`plan_preemption`): an assignment whose training is expected to
finish, and its result to be uploaded, before the notice expires is let run; every other one is
abandoned at once, so the scheduler can hand its workunit to another host without waiting for
the deadline.
"""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit, urlunsplit

import httpx

log = logging.getLogger(__name__)

AWS_SPOT_NOTICE_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
TOKEN_TTL_SECONDS = 21600
SAFETY_MARGIN_SECONDS = 5.0


@dataclass(frozen=True)
class Notice:
    action: str
    at: float  # unix time at which the instance goes away


@dataclass(frozen=True)
class RunningEstimate:
    assignment_id: int
    remaining_seconds: float | None  # expected training time left; None when nothing is known


def plan_preemption(
    running: list[RunningEstimate],
    notice_at: float,
    now: float,
    upload_seconds: float,
    margin: float = SAFETY_MARGIN_SECONDS,
) -> tuple[set[int], set[int]]:
    """Split running assignments into (finish, abandon) for a notice that expires at `notice_at`.

    An assignment is finished only if its remaining training plus one upload fits before the
    notice expires with `margin` to spare; with no estimate it is abandoned.
    """
    finish: set[int] = set()
    abandon: set[int] = set()
    for r in running:
        fits = r.remaining_seconds is not None and now + r.remaining_seconds + upload_seconds + margin <= notice_at
        (finish if fits else abandon).add(r.assignment_id)
    return finish, abandon


def _token_url(notice_url: str) -> str:
    parts = urlsplit(notice_url)
    return urlunsplit((parts.scheme, parts.netloc, "/latest/api/token", "", ""))


def parse_notice(body: dict) -> Notice:
    """`{"action": "terminate", "time": "2026-11-22T18:00:00Z"}` -> Notice."""
    at = datetime.fromisoformat(body["time"].replace("Z", "+00:00"))
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return Notice(str(body.get("action", "terminate")), at.timestamp())


class SpotNoticeWatcher:
    """Polls the notice URL every `interval` seconds until a notice appears or `stop` is set.

    Calls `on_notice` once. An endpoint that cannot be reached at all on the first poll (not a
    cloud instance) ends the watch quietly; later failures are retried.
    """

    def __init__(
        self,
        url: str,
        interval: float,
        on_notice: Callable[[Notice], None],
        stop: threading.Event,
        timeout: float = 1.0,
    ):
        self.url = url
        self.interval = interval
        self.on_notice = on_notice
        self.stop = stop
        self.http = httpx.Client(timeout=timeout)
        self._token: str | None = None

    def _headers(self) -> dict[str, str]:
        if self._token is None:
            resp = self.http.put(
                _token_url(self.url), headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_SECONDS)}
            )
            # IMDSv1-only endpoints have no token route: poll without one.
            self._token = resp.text if resp.status_code == 200 else ""
        return {"X-aws-ec2-metadata-token": self._token} if self._token else {}

    def poll(self) -> Notice | None:
        resp = self.http.get(self.url, headers=self._headers())
        if resp.status_code == 401:  # the session token expired
            self._token = None
            resp = self.http.get(self.url, headers=self._headers())
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        return parse_notice(resp.json())

    def run(self) -> None:
        first = True
        try:
            while not self.stop.is_set():
                try:
                    notice = self.poll()
                except httpx.TransportError as exc:
                    if first:
                        log.info("no spot-interruption endpoint at %s (%s); not watching", self.url, exc)
                        return
                    log.debug("spot notice poll failed: %s", exc)
                    notice = None
                except (httpx.HTTPStatusError, ValueError, KeyError) as exc:
                    log.warning("unreadable spot notice at %s: %s", self.url, exc)
                    notice = None
                first = False
                if notice is not None:
                    self.on_notice(notice)
                    return
                self.stop.wait(self.interval)
        finally:
            self.http.close()
