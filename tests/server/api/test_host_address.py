"""A host's address and network are recorded at registration, from the connection, never from the body."""

from crowdtrain.server.ledger.models import Host
from tests.server.inprocess import private_scheduler


def test_registration_records_the_callers_address_and_network(tmp_path) -> None:
    with private_scheduler(tmp_path) as sched:
        sched.register_token("a", address="203.0.113.7")
        sched.register_token("b", address="::ffff:203.0.113.99")
        sched.register_token("c", address="testclient")
        with sched.db.begin() as s:
            rows = {h.name: (h.address, h.network) for h in s.query(Host)}
    assert rows == {
        "a": ("203.0.113.7", "203.0.113.0/24"),
        "b": ("203.0.113.99", "203.0.113.0/24"),
        "c": ("", ""),
    }
