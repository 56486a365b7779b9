"""Refusals: requests the system will not honour, said in the domain's terms rather than the wire's.

Services and the ledger raise a `Refusal` (or a subclass) with a `RefusalKind`; the API answers it
with the status code its one table (crowdtrain.server.api.boundary) gives that kind, and the
refusal's message as the error's `detail`. Nothing here knows about HTTP.
"""

from enum import StrEnum


class RefusalKind(StrEnum):
    """Why a request is refused."""

    malformed = "malformed"  # the content cannot be read as what it claims to be
    unauthenticated = "unauthenticated"  # the caller's credentials are missing, unknown or revoked
    forbidden = "forbidden"  # the caller is known but may not do this
    not_found = "not_found"  # the thing named does not exist (or is not the caller's to see)
    conflict = "conflict"  # the thing exists but its current state does not allow this
    unacceptable = "unacceptable"  # well-formed, but not something the system can accept
    throttled = "throttled"  # too many attempts: retry after `retry_after` seconds


class Refusal(Exception):
    """A request refused for a reason the caller can act on; `kind` says which, `message` says what.

    Subclasses fix their `kind` as a class attribute; the constructor's `kind` overrides it.
    """

    kind: RefusalKind = RefusalKind.conflict
    retry_after: int | None = None

    def __init__(self, message: str, kind: RefusalKind | None = None):
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind


class NotFound(Refusal, LookupError):
    """The record a request names does not exist."""

    kind = RefusalKind.not_found
