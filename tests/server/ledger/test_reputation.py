"""The ledger's reputation rules against a real SQLite and PostgreSQL ledger: the quarantine a new host
inherits from its account or network, at a given time."""

from datetime import datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger import reputation
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Host

T0 = datetime(2026, 11, 24, 12, 0, 0)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest) -> sessionmaker[Session]:
    url = request.getfixturevalue(f"{request.param}_url".replace("postgresql", "postgres"))
    upgrade(url)
    return session_factory(url)


def add_host(db: sessionmaker[Session], name: str, account: str, network: str, until: datetime | None) -> int:
    with db.begin() as s:
        host = Host(name=name, token_hash=name.ljust(64, "0"), account=account, network=network)
        host.quarantined_until, host.quarantine_reason = until, f"{name} sent NaN" if until else ""
        host.results_valid, host.results_failed, host.consecutive_refused = 1, 5, 3
        s.add(host)
        s.flush()
        return host.id


@pytest.mark.parametrize(
    ("account", "network", "minutes", "inherited_from"),
    [
        ("mallory", "", 0, "late"),  # of two quarantines of one account, the longer
        ("mallory", "", 90, "late"),  # the shorter has ended: the other still holds
        ("mallory", "", 150, None),  # both have ended
        ("", "203.0.113.0/24", 0, "neighbour"),
        ("alice", "198.51.100.0/24", 0, None),  # alice's host is not quarantined, nor is its network
        ("", "", 0, None),  # neither followed
    ],
)
def test_a_new_host_inherits_the_longest_quarantine_of_its_account_or_network(
    db, account: str, network: str, minutes: int, inherited_from: str | None
) -> None:
    ids = {
        "late": add_host(db, "late", "mallory", "192.0.2.0/24", T0 + timedelta(hours=2)),
        "early": add_host(db, "early", "mallory", "192.0.2.0/24", T0 + timedelta(hours=1)),
        "neighbour": add_host(db, "neighbour", "eve", "203.0.113.0/24", T0 + timedelta(minutes=30)),
        "alice": add_host(db, "alice", "alice", "198.51.100.0/24", None),
    }
    with db.begin() as s:
        found = reputation.quarantine_to_inherit(s, account, network, T0 + timedelta(minutes=minutes))
        assert (found.id if found else None) == (ids[inherited_from] if inherited_from else None)


def test_an_inheriting_host_takes_the_quarantine_its_reason_and_the_record(db) -> None:
    source_id = add_host(db, "mallory", "mallory", "", T0 + timedelta(hours=1))
    with db.begin() as s:
        source = s.get_one(Host, source_id)
        new = Host(name="mallory", token_hash="n" * 64, account="mallory")
        reputation.inherit_quarantine(new, source)
        assert new.quarantined_until == source.quarantined_until
        assert new.quarantine_reason == f"as host {source_id} of the same account or network: mallory sent NaN"
        assert (new.results_valid, new.results_failed, new.consecutive_refused) == (1, 5, 3)
        again = Host(name="mallory", token_hash="m" * 64, account="mallory")
        reputation.inherit_quarantine(again, new)
        assert again.quarantine_reason == new.quarantine_reason, "a chain of inheritances names the first host"
