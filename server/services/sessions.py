"""The operator's dashboard session: a cookie value that proves a login with the admin token.

The value is `EXPIRY.SIGNATURE`, an HMAC-SHA256 of the expiry (Unix seconds) under a key derived from
the admin token. It is not the token and does not reveal it; it is good until its expiry, and a new
admin token ends every session at once (the key changes). No state is stored. No I/O.
"""

import hashlib
import hmac
import time

_KEY_LABEL = b"crowdtrain dashboard session v1\x00"


def _signature(admin_token: str, expiry: int) -> str:
    key = hashlib.sha256(_KEY_LABEL + admin_token.encode()).digest()
    return hmac.new(key, str(expiry).encode(), hashlib.sha256).hexdigest()


def is_admin_token(admin_token: str, candidate: str) -> bool:
    """Whether `candidate` is the admin token (compared in constant time; never when none is set)."""
    return bool(admin_token) and hmac.compare_digest(candidate.encode(), admin_token.encode())


def issue(admin_token: str, lifetime_seconds: int, now: float | None = None) -> str:
    """A session value that expires `lifetime_seconds` from `now` (the clock if None)."""
    expiry = int(now if now is not None else time.time()) + lifetime_seconds
    return f"{expiry}.{_signature(admin_token, expiry)}"


def is_valid(admin_token: str, value: str | None, now: float | None = None) -> bool:
    """Whether `value` was issued under `admin_token` and has not expired. Any malformed value is invalid."""
    if not admin_token or not value or len(value) > 100:
        return False
    expiry_text, _, signature = value.partition(".")
    if not (expiry_text.isascii() and expiry_text.isdigit()) or len(expiry_text) > 12:
        return False
    expiry = int(expiry_text)
    if expiry <= (now if now is not None else time.time()):
        return False
    return hmac.compare_digest(signature.encode(), _signature(admin_token, expiry).encode())
