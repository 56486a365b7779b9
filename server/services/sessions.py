"""The operator's dashboard session: a cookie value that proves a login with the admin token.

The value is `EXPIRY.NONCE.SIGNATURE`, an HMAC-SHA256 of the expiry (Unix seconds) and a random nonce
under a key derived from the admin token. It is not the token and does not reveal it; it is good until
its expiry or its logout, and a new admin token ends every session at once (the key changes).

Logout ends a session on the server, not only in the browser that drops the cookie (a copied cookie
would live on): `end` marks the session's nonce in Redis until the value's own expiry, and `is_live`
refuses a marked one. Everything else here is pure.
"""

import hashlib
import hmac
import secrets

import redis

from crowdtrain.core import keys
from crowdtrain.server.services.clock import now_or_wall

_KEY_LABEL = b"crowdtrain dashboard session v2\x00"
_MAX_LENGTH = 120


def _signature(admin_token: str, expiry: int, nonce: str) -> str:
    key = hashlib.sha256(_KEY_LABEL + admin_token.encode()).digest()
    return hmac.new(key, f"{expiry}.{nonce}".encode(), hashlib.sha256).hexdigest()


def is_admin_token(admin_token: str, candidate: str) -> bool:
    """Whether `candidate` is the admin token (compared in constant time; never when none is set)."""
    return bool(admin_token) and hmac.compare_digest(candidate.encode(), admin_token.encode())


def issue(admin_token: str, lifetime_seconds: int, now: float | None = None) -> str:
    """A new session value that expires `lifetime_seconds` from `now` (the clock if None)."""
    expiry = int(now_or_wall(now)) + lifetime_seconds
    nonce = secrets.token_urlsafe(16)
    return f"{expiry}.{nonce}.{_signature(admin_token, expiry, nonce)}"


def _expiry(admin_token: str, value: str | None, now: float | None) -> int | None:
    """The expiry of `value` if it was issued under `admin_token` and has not expired, else None."""
    if not admin_token or not value or len(value) > _MAX_LENGTH:
        return None
    expiry_text, _, rest = value.partition(".")
    nonce, _, signature = rest.partition(".")
    if not (expiry_text.isascii() and expiry_text.isdigit()) or len(expiry_text) > 12 or not nonce:
        return None
    expiry = int(expiry_text)
    if expiry <= now_or_wall(now):
        return None
    if not hmac.compare_digest(signature.encode(), _signature(admin_token, expiry, nonce).encode()):
        return None
    return expiry


def is_valid(admin_token: str, value: str | None, now: float | None = None) -> bool:
    """Whether `value` was issued under `admin_token` and has not expired (logout aside: `is_live`).
    Any malformed value is invalid."""
    return _expiry(admin_token, value, now) is not None


def _session_id(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def is_live(r: redis.Redis, admin_token: str, value: str | None, now: float | None = None) -> bool:
    """Whether `value` is valid and its session has not been ended by a logout (one Redis read, made
    only for a valid value)."""
    if value is None or not is_valid(admin_token, value, now):
        return False
    return not r.exists(keys.ended_session(_session_id(value)))


def end(r: redis.Redis, admin_token: str, value: str | None, now: float | None = None) -> bool:
    """End the session `value` everywhere, for what is left of its life (the mark expires with it);
    whether there was a valid session to end. Idempotent."""
    expiry = _expiry(admin_token, value, now)
    if value is None or expiry is None:
        return False
    r.set(keys.ended_session(_session_id(value)), 1, ex=max(1, int(expiry - now_or_wall(now))))
    return True
