"""The registration policy: how many hosts a join token and a network may register in a sliding hour, the
account a host is under, and the quarantine it inherits (crowdtrain.server.ledger.reputation).

Registrations are counted from the hosts table, so the limits hold across scheduler processes and
restarts. A host is cheap to make and each one is a vote in a replica comparison: without a limit, one
join token made 200 hosts in 3.5 s. Two registrations that race may both be admitted on PostgreSQL
(each counts before the other commits); a join token's are serialised by locking its row.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from crowdtrain.core.refusals import Refusal, RefusalKind
from crowdtrain.core.settings import Settings
from crowdtrain.server.ledger import reputation
from crowdtrain.server.ledger.models import Host, JoinToken

WINDOW = timedelta(hours=1)


@dataclass(frozen=True)
class RegistrationPolicy:
    """The limits per hour, and whether quarantine follows the network as well as the account."""

    per_token: int = 100  # a join token's own registrations_per_hour overrides it
    per_network: int = 20
    quarantine_follows_network: bool = True

    @classmethod
    def from_settings(cls, settings: Settings) -> "RegistrationPolicy":
        return cls(
            settings.registrations_per_hour_per_token,
            settings.registrations_per_hour_per_network,
            settings.quarantine_follows_network,
        )


DEFAULT_POLICY = RegistrationPolicy()  # the settings' defaults


class RegistrationLimited(Refusal):
    """Too many registrations in the last hour by one join token or from one network (429, Retry-After)."""

    kind = RefusalKind.throttled

    def __init__(self, who: str, limit: int, retry_after: int):
        super().__init__(
            f"{who} registered {limit} hosts in the last hour, its limit; retry in {retry_after}s "
            "(the operator can issue a join token with a higher limit)"
        )
        self.retry_after = retry_after


def seconds_until_admitted(recent: Sequence[datetime], limit: int, now: datetime) -> int | None:
    """None if one more registration is within `limit` per WINDOW ending at `now`, given the times of the most
    recent registrations (at least `limit` of them where there are as many, newest first); else the whole
    seconds until the oldest of the last `limit` leaves the window. No I/O."""
    in_window = [t for t in recent if t > now - WINDOW]
    if len(in_window) < limit:
        return None
    oldest_counted = in_window[limit - 1]
    return max(math.ceil((oldest_counted + WINDOW - now).total_seconds()), 1)


def host_account(token_account: str, named: str) -> str:
    """The account a host is under: its join token's if the token was issued to one (whatever the host names:
    an account is not a free string for a volunteer given a token of their own), else the one it names."""
    return token_account or named


def _recent(s: Session, where, limit: int, now: datetime) -> list[datetime]:
    return list(
        s.scalars(
            select(Host.created_at)
            .where(where, Host.created_at > now - WINDOW)
            .order_by(Host.created_at.desc())
            .limit(limit)
        )
    )


def admit(s: Session, policy: RegistrationPolicy, token: JoinToken | None, network: str, now: datetime) -> None:
    """Raise RegistrationLimited if one more host registered at `now` with `token` (None: the bootstrap token
    from the settings) from `network` ("" when the address is not an IP address: not limited) would exceed
    the token's limit or the network's. Counts the hosts table; stores nothing."""
    limit = policy.per_token if token is None or token.registrations_per_hour is None else token.registrations_per_hour
    by_token = Host.join_token_id.is_(None) if token is None else Host.join_token_id == token.id
    wait = seconds_until_admitted(_recent(s, by_token, limit, now), limit, now)
    if wait is not None:
        name = "the bootstrap join token" if token is None else f"join token {token.id} ({token.label})"
        raise RegistrationLimited(name, limit, wait)
    if network:
        limit = policy.per_network
        wait = seconds_until_admitted(_recent(s, Host.network == network, limit, now), limit, now)
        if wait is not None:
            raise RegistrationLimited(f"network {network}", limit, wait)


def inherit_quarantine(s: Session, policy: RegistrationPolicy, host: Host, now: datetime) -> None:
    """Quarantine the new `host` if its account (or, unless the policy says not, its network) has a host in
    quarantine at `now`: re-registering does not end a quarantine."""
    network = host.network if policy.quarantine_follows_network else ""
    source = reputation.quarantine_to_inherit(s, host.account, network, now)
    if source is not None:
        reputation.inherit_quarantine(host, source)
