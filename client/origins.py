"""Where the client may download from: the scheduler's origin and the object store's.

An origin is `scheme://host:port` (RFC 6454), written here always with its port and its host in one
canonical spelling (`canonical_host`): lower case, no trailing dot, an IPv4 address as a dotted quad
however it was written (`2130706433`, `0x7f000001`, `127.1`, `[::ffff:127.0.0.1]` are 127.0.0.1, as
the resolver would take them), an IPv6 address compressed. The scheduler's URLs are untrusted strings:
a URL is fetched only if the origin of the request httpx is about to send (the very URL object it
sends, so no second parser can disagree) is one of `Origins`. The host token goes only to the
scheduler's origin. Other origins come from the volunteer (`--allow-origin`, preference
`download_origins`) or from the scheduler once, at registration; learned ones are pinned with the host
token and never taken from a later reply. An address no object store has (link-local such as the
cloud metadata service 169.254.169.254, the metadata services' other addresses, unspecified,
multicast) is never fetched from, whoever allows it, and never learned; a loopback address is learned
only from a scheduler that is itself on loopback (a remote scheduler cannot point the client at the
volunteer's own machine).
"""

import ipaddress
import logging
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_URL_CHARS = 4096
# Cloud metadata and credential services that are not link-local: AWS's IPv6 IMDS, Alibaba's.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200"))
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata"})
# A host the resolver reads as an IPv4 address (inet_aton): labels of decimal, octal or 0x-hex digits.
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
# NAT64's well-known prefix: 64:ff9b::a.b.c.d reaches a.b.c.d.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class ForbiddenURL(ValueError):
    """A server-supplied URL that the client will not fetch; the message says why."""


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches: IPv4-mapped, NAT64 or (deprecated) IPv4-compatible."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or (int(ip) >> 32 == 0 and int(ip) > 0xFFFF):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def canonical_host(host: str) -> str:
    """One spelling per host (see the module docstring); ForbiddenURL for a numeric host that is no address."""
    host = host.lower().rstrip(".")
    if not host:
        raise ForbiddenURL("URL has no host")
    if ":" in host:
        try:
            ip6 = ipaddress.IPv6Address(host)
        except ValueError:
            raise ForbiddenURL(f"URL host {host!r:.80} is not an IPv6 address") from None
        v4 = _embedded_ipv4(ip6)
        return str(v4) if v4 is not None else ip6.compressed
    if all(_NUMERIC_LABEL.match(label) for label in host.split(".")):
        try:
            return socket.inet_ntoa(socket.inet_aton(host))
        except OSError:
            raise ForbiddenURL(f"URL host {host!r:.80} is not an IPv4 address") from None
    return host


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def never_fetched(host: str) -> bool:
    """Whether a canonical host is one no download comes from: a metadata service, or a link-local,
    unspecified or multicast address."""
    ip = _address(host)
    if ip is None:
        return host in METADATA_NAMES
    return ip in METADATA_ADDRESSES or ip.is_link_local or ip.is_unspecified or ip.is_multicast


def _is_loopback(host: str) -> bool:
    ip = _address(host)
    return host == "localhost" or host.endswith(".localhost") or (ip is not None and ip.is_loopback)


def origin_of(url: httpx.URL) -> str:
    """`scheme://host:port` of an absolute http(s) URL without user info, its host canonical;
    ForbiddenURL otherwise."""
    if url.scheme not in DEFAULT_PORTS:
        raise ForbiddenURL(f"URL scheme {url.scheme!r} is not http or https")
    if not url.host:
        raise ForbiddenURL("URL has no host")
    if url.userinfo:
        raise ForbiddenURL("URL carries user info")
    if url.port is not None and not 0 < url.port < 65536:
        raise ForbiddenURL(f"URL port {url.port} is out of range")
    host = canonical_host(url.host)
    host = f"[{host}]" if ":" in host else host
    return f"{url.scheme}://{host}:{url.port or DEFAULT_PORTS[url.scheme]}"


def host_of(origin: str) -> str:
    """The canonical host of an origin made by `origin_of`."""
    return httpx.URL(origin).host


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


def learnable(origin: str, scheduler: str) -> bool:
    """False for hosts that no object store has (`never_fetched`), and for loopback hosts unless the
    scheduler (an origin) is on loopback too."""
    host = host_of(origin)
    if never_fetched(host):
        return False
    return not _is_loopback(host) or _is_loopback(host_of(scheduler))


def learned_origins(announced: list[str], scheduler: str) -> list[str]:
    """The origins the scheduler (an origin) announced that the client accepts at registration; the
    rest are logged and dropped."""
    kept = []
    for text in announced:
        try:
            origin = parse_origin(text)
        except ValueError as exc:
            log.warning("ignoring the scheduler's download origin: %s", exc)
            continue
        if not learnable(origin, scheduler):
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
        if never_fetched(host_of(origin)):
            raise ForbiddenURL(f"refusing to download from {origin}: a metadata or link-local address")
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
