"""Where the client may download from: the scheduler's origin and the object store's.

An origin is `scheme://host:port` (RFC 6454), written here always with its port. The scheduler's
URLs are untrusted strings: a URL is fetched only if the origin of the request httpx is about to
send (the very URL object it sends, so no second parser can disagree) is one of `Origins`. The
host token goes only to the scheduler's origin. Other origins come from the volunteer
(`--allow-origin`, preference `download_origins`) or from the scheduler once, at registration;
learned ones are pinned with the host token and never taken from a later reply, and an address
no object store has (link-local such as the cloud metadata service 169.254.169.254,
unspecified, multicast) is never learned.
"""

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_URL_CHARS = 4096


class ForbiddenURL(ValueError):
    """A server-supplied URL that the client will not fetch; the message says why."""


def origin_of(url: httpx.URL) -> str:
    """`scheme://host:port` of an absolute http(s) URL without user info; ForbiddenURL otherwise."""
    if url.scheme not in DEFAULT_PORTS:
        raise ForbiddenURL(f"URL scheme {url.scheme!r} is not http or https")
    if not url.host:
        raise ForbiddenURL("URL has no host")
    if url.userinfo:
        raise ForbiddenURL("URL carries user info")
    if url.port is not None and not 0 < url.port < 65536:
        raise ForbiddenURL(f"URL port {url.port} is out of range")
    host = f"[{url.host}]" if ":" in url.host else url.host
    return f"{url.scheme}://{host}:{url.port or DEFAULT_PORTS[url.scheme]}"


def parse_origin(text: str) -> str:
    """A configured or announced origin, normalized; ValueError unless it is one (no path, query...)."""
    if not isinstance(text, str) or len(text) > 300 or not text.isascii() or any(c <= " " for c in text):
        raise ValueError(f"{text!r} is not an origin such as https://s3.example.org:9000")
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{text!r} is not an origin: {exc}") from None
    if url.path not in ("", "/") or url.query or url.fragment:
        raise ValueError(f"{text!r} is not an origin: it has a path, query or fragment")
    try:
        return origin_of(url)
    except ForbiddenURL as exc:
        raise ValueError(f"{text!r} is not an origin: {exc}") from None


def learnable(origin: str) -> bool:
    """False for hosts that no object store has: link-local, unspecified or multicast addresses."""
    host = httpx.URL(origin).host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host != "metadata.google.internal"
    return not (ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def learned_origins(announced: list[str]) -> list[str]:
    """The announced origins the client accepts at registration; the rest are logged and dropped."""
    kept = []
    for text in announced:
        try:
            origin = parse_origin(text)
        except ValueError as exc:
            log.warning("ignoring the scheduler's download origin: %s", exc)
            continue
        if not learnable(origin):
            log.warning("ignoring the scheduler's download origin %s: not an object store's address", origin)
            continue
        kept.append(origin)
    return kept


@dataclass(frozen=True)
class Origins:
    """The scheduler's origin and the other origins downloads may come from."""

    scheduler: str
    others: frozenset[str] = frozenset()

    @classmethod
    def for_scheduler(cls, server_url: str, others: Iterable[str] = ()) -> "Origins":
        return cls(origin_of(httpx.URL(server_url)), frozenset(parse_origin(o) for o in others))

    def check(self, url: httpx.URL) -> str:
        """The origin of `url` if downloads may come from it; ForbiddenURL naming it otherwise."""
        origin = origin_of(url)
        if origin != self.scheduler and origin not in self.others:
            raise ForbiddenURL(
                f"refusing to download from {origin}: only the scheduler ({self.scheduler}) and "
                f"allowed object stores ({', '.join(sorted(self.others)) or 'none'}) are; "
                "a volunteer can allow one with --allow-origin"
            )
        return origin


def check_url_text(url: str) -> None:
    """Refuse a server-supplied URL string before it is parsed: bounded, printable ASCII."""
    if len(url) > MAX_URL_CHARS:
        raise ForbiddenURL(f"URL of {len(url)} characters is longer than {MAX_URL_CHARS}")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url) or "\\" in url:
        raise ForbiddenURL("URL has control, space, backslash or non-ASCII characters")
