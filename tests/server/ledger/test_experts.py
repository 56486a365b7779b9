"""Expert leases in the database, on SQLite and PostgreSQL, with the clock passed in: leased out a few
at a time, renewed by the host's calls, expired and leased anew, checkpoints recorded by the lease
holder only, and a routing table that tells trainers what changed."""

from datetime import datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.refusals import NotFound, Refusal, RefusalKind
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger import expert_calls, experts
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Host

LAYOUT = ExpertLayout(layers=1, grid=[2, 3], dim=4, hidden=8, k=2, heartbeat_seconds=10, lease_heartbeats=3)
T0 = datetime(2026, 1, 1)
LEASE = timedelta(seconds=30)  # 3 heartbeats of 10 s


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path) -> sessionmaker[Session]:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")
    upgrade(url)
    factory = session_factory(url)
    with factory.begin() as s:
        s.add_all(Host(name=f"h{i}", token_hash=f"{i:064d}") for i in (1, 2))
    return factory


def renew(*args, **kwargs) -> list[experts.Lease]:
    """The host's leases after its call (experts.renew_and_lease)."""
    return experts.renew_and_lease(*args, **kwargs).leases


def uids(leases: list[experts.Lease]) -> list[str]:
    return [lease.uid for lease in leases]


def routes(db, mixture: int, since: int) -> tuple[int, dict[str, str | None]]:
    version, changed = experts.routing_changes(db, mixture, since)
    return version, {r.uid: r.url for r in changed}


def test_hosts_that_ask_together_share_the_experts_out_a_few_at_a_call(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    first = renew(db, 1, mixture, "http://a:1", 100, at(0), grant=True)
    second = renew(db, 2, mixture, "http://b:1", 100, at(1), grant=True)
    assert uids(first) == ["0.0.0", "0.0.1", "0.0.2", "0.1.0"]  # LEASES_PER_CALL at most
    assert uids(second) == ["0.1.1", "0.1.2"]
    assert all(lease.expires_at == at(1) + LEASE for lease in second)
    assert renew(db, 1, mixture, "http://a:1", 100, at(2), grant=True)[0].expires_at == at(2) + LEASE


def test_a_host_gets_no_more_than_its_capacity_and_nothing_without_the_probe(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    assert renew(db, 1, mixture, "http://a:1", 3, at(0), grant=False) == []
    assert len(renew(db, 1, mixture, "http://a:1", 3, at(0), grant=True)) == 3
    assert len(renew(db, 1, mixture, "http://a:1", 3, at(1), grant=True)) == 3


def test_a_call_says_whether_a_free_expert_is_left_that_the_host_has_room_for(db) -> None:
    """What decides whether the scheduler probes the host: free experts (6 in the layout), and room."""
    mixture = experts.create_mixture(db, "m", LAYOUT)
    assert experts.renew_and_lease(db, 1, mixture, "http://a:1", 2, at(0), grant=False).more
    taken = experts.renew_and_lease(db, 1, mixture, "http://a:1", 2, at(0), grant=True)
    assert len(taken.leases) == 2 and not taken.more  # free ones are left, but host 1 is full
    assert not experts.renew_and_lease(db, 1, mixture, "http://a:1", 2, at(1), grant=False).more
    assert experts.renew_and_lease(db, 2, mixture, "http://b:1", 10, at(1), grant=False).more
    rest = experts.renew_and_lease(db, 2, mixture, "http://b:1", 10, at(1), grant=True)
    assert len(rest.leases) == 4 and not rest.more  # room left, but every expert is leased
    assert not experts.renew_and_lease(db, 1, mixture, "http://a:1", 10, at(2), grant=False).more
    # Host 2 keeps calling, host 1 stops: once its leases end, its experts are free again.
    assert not experts.renew_and_lease(db, 2, mixture, "http://b:1", 10, at(30), grant=False).more
    assert experts.renew_and_lease(db, 2, mixture, "http://b:1", 10, at(32), grant=False).more


def test_a_lease_not_renewed_ends_and_its_expert_goes_to_the_next_host_that_asks(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    renew(db, 1, mixture, "http://a:1", 1, at(0), grant=True)  # 0.0.0 to host 1
    renew(db, 2, mixture, "http://b:1", 6, at(0), grant=True)  # four more to host 2
    version, _ = routes(db, mixture, 0)
    # Host 1 stops calling. Before its lease ends, nobody else gets 0.0.0; after, host 2 does.
    assert "0.0.0" not in uids(renew(db, 2, mixture, "http://b:1", 6, at(29), grant=True))
    moved = renew(db, 2, mixture, "http://b:1", 6, at(31), grant=True)
    assert "0.0.0" in uids(moved)
    assert routes(db, mixture, version)[1]["0.0.0"] == "http://b:1"
    # Host 1 comes back: 0.0.0 is not among its leases any more, which is how it learns it lost it.
    assert renew(db, 1, mixture, "http://a:1", 1, at(32), grant=False) == []


def test_the_transitioner_frees_ended_leases_and_trainers_see_the_experts_without_a_host(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    renew(db, 1, mixture, "http://a:1", 2, at(0), grant=True)
    version, table = routes(db, mixture, 0)
    assert table == {"0.0.0": "http://a:1", "0.0.1": "http://a:1"}
    assert experts.expire_leases(db, at(29)) == 0
    assert experts.expire_leases(db, at(30)) == 2
    newer, changed = routes(db, mixture, version)
    assert newer > version and changed == {"0.0.0": None, "0.0.1": None}
    assert routes(db, mixture, newer) == (newer, {})
    assert experts.expire_leases(db, at(60)) == 0


def test_a_host_that_moves_to_another_url_is_followed(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    renew(db, 1, mixture, "http://a:1", 1, at(0), grant=True)
    version, _ = routes(db, mixture, 0)
    renew(db, 1, mixture, "http://a:2", 1, at(5), grant=False)
    assert routes(db, mixture, version)[1] == {"0.0.0": "http://a:2"}


def test_only_the_lease_holder_records_a_checkpoint_and_only_a_newer_one(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    renew(db, 1, mixture, "http://a:1", 1, at(0), grant=True)
    assert experts.record_checkpoint(db, 1, mixture, "0.0.0", 5, "k5", at(1)) is None
    assert experts.record_checkpoint(db, 1, mixture, "0.0.0", 9, "k9", at(2)) == "k5"
    with pytest.raises(Refusal, match="not newer") as stale:
        experts.record_checkpoint(db, 1, mixture, "0.0.0", 9, "k9b", at(3))
    assert stale.value.kind is RefusalKind.conflict
    with pytest.raises(Refusal, match="not leased to this host") as other:
        experts.record_checkpoint(db, 2, mixture, "0.0.0", 12, "k12", at(3))
    assert other.value.kind is RefusalKind.forbidden
    with pytest.raises(Refusal, match="not leased to this host"):  # its lease ended
        experts.record_checkpoint(db, 1, mixture, "0.0.0", 12, "k12", at(31))
    with pytest.raises(NotFound, match="no expert"):
        experts.record_checkpoint(db, 1, mixture, "7.7.7", 1, "k", at(1))
    # The next host to lease the expert is told where to restore it from.
    (lease,) = renew(db, 2, mixture, "http://b:1", 1, at(40), grant=True)
    assert (lease.uid, lease.checkpoint_key, lease.checkpoint_step) == ("0.0.0", "k9", 9)


def test_an_unknown_mixture_is_not_found(db) -> None:
    with pytest.raises(NotFound, match="mixture 99"):
        renew(db, 1, 99, "http://a:1", 1, at(0), grant=True)
    with pytest.raises(NotFound, match="mixture 99"):
        experts.routing_changes(db, 99, 0)


def calls(uid: str, url: str, answered: int = 0, rows: int = 0, refused: int = 0, failed: int = 0, late: int = 0):
    return expert_calls.CallCounts(uid, url, answered, rows, failed, late, refused)


def host_row(db, host_id: int) -> Host:
    with db.begin() as s:
        host = s.get_one(Host, host_id)
        s.expunge(host)
        return host


def test_a_trainers_report_counts_for_the_experts_current_hosts_only_and_credits_what_they_answered(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    renew(db, 1, mixture, "http://a:1", 2, at(0), grant=True)  # 0.0.0, 0.0.1 to host 1
    renew(db, 2, mixture, "http://b:1", 1, at(0), grant=True)  # 0.0.2 to host 2
    report = [
        calls("0.0.0", "http://a:1", answered=10, rows=640, failed=1, late=2),
        calls("0.0.1", "http://old:1", answered=5, rows=320),  # a host it had before: not counted
        calls("0.0.2", "http://b:1", answered=4, rows=256),  # host 2 reporting on itself: not counted
        calls("1.0.0", "http://a:1", answered=1, rows=1),  # no such expert
    ]
    assert expert_calls.record_calls(db, 2, mixture, report, 60.0, at(10), quarantine_after=5) == (1, 3)
    assert expert_calls.record_calls(db, 2, mixture, report[:1], 30.0, at(40), quarantine_after=5) == (1, 0)
    _, rows = expert_calls.mixture_experts(db, mixture)
    view = {r.uid: r for r in rows}
    assert (view["0.0.0"].answered, view["0.0.0"].failed, view["0.0.0"].late) == (20, 2, 4)
    assert view["0.0.0"].reported_seconds == 90.0  # from 60 s before the first report to the second
    assert view["0.0.1"].answered == view["0.0.2"].answered == 0
    # Credit for the rows answered: 1,280 rows of a dim-4, hidden-8 expert, 8 x 4 x 8 FLOPs each.
    assert host_row(db, 1).credit == pytest.approx(1280 * 8 * 4 * 8 / 4.32e11)
    assert host_row(db, 2).credit == 0


def test_refused_answers_charge_their_host_until_it_is_quarantined_and_its_experts_freed(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT)
    renew(db, 1, mixture, "http://a:1", 2, at(0), grant=True)  # 0.0.0, 0.0.1 to host 1
    version, _ = routes(db, mixture, 0)
    expert_calls.record_calls(db, 2, mixture, [calls("0.0.0", "http://a:1", refused=3)], 10.0, at(5), 5)
    charged = host_row(db, 1)
    assert (charged.results_failed, charged.consecutive_refused, charged.quarantined_until) == (3, 3, None)
    # Usable answers end the run of refusals; two more refused do not reach 5 in a row.
    expert_calls.record_calls(db, 2, mixture, [calls("0.0.1", "http://a:1", answered=4, rows=8)], 10.0, at(6), 5)
    expert_calls.record_calls(db, 2, mixture, [calls("0.0.0", "http://a:1", refused=2)], 10.0, at(7), 5)
    assert host_row(db, 1).quarantined_until is None
    expert_calls.record_calls(db, 2, mixture, [calls("0.0.0", "http://a:1", refused=3)], 10.0, at(8), 5)
    quarantined = host_row(db, 1)
    assert quarantined.quarantined_until is not None and "answers refused" in quarantined.quarantine_reason
    # Its experts are freed at once: trainers stop calling it, and its next call leases it nothing.
    assert routes(db, mixture, version)[1] == {"0.0.0": None, "0.0.1": None}
    assert renew(db, 1, mixture, "http://a:1", 2, at(9), grant=True) == []
    assert uids(renew(db, 2, mixture, "http://b:1", 2, at(9), grant=True)) == ["0.0.0", "0.0.1"]


def test_replicas_of_an_expert_go_to_different_hosts_and_the_newest_checkpoint_of_any_restores(db) -> None:
    mixture = experts.create_mixture(db, "m", LAYOUT.model_copy(update={"replicas": 2, "grid": [2]}))
    with db.begin() as s:
        s.add(Host(name="h3", token_hash=f"{3:064d}"))
    first = renew(db, 1, mixture, "http://a:1", 100, at(0), grant=True)
    assert [(x.uid, x.replica) for x in first] == [("0.0", 0), ("0.1", 0)]  # never two replicas of one
    second = renew(db, 2, mixture, "http://b:1", 100, at(1), grant=True)
    assert [(x.uid, x.replica) for x in second] == [("0.0", 1), ("0.1", 1)]
    assert renew(db, 3, mixture, "http://c:1", 100, at(2), grant=True) == []  # every replica is served
    _, changed = experts.routing_changes(db, mixture, 0)
    assert sorted((r.uid, r.replica, r.url) for r in changed) == [
        ("0.0", 0, "http://a:1"),
        ("0.0", 1, "http://b:1"),
        ("0.1", 0, "http://a:1"),
        ("0.1", 1, "http://b:1"),
    ]
    experts.record_checkpoint(db, 1, mixture, "0.0", 40, "ckpt/a40", at(3))
    experts.record_checkpoint(db, 2, mixture, "0.0", 30, "ckpt/b30", at(3))
    a, b = (experts.check_lease(db, host, mixture, "0.0", at(4)) for host in (1, 2))
    assert (a.checkpoint_key, a.peer_key, a.own_key) == ("ckpt/a40", "ckpt/b30", "ckpt/a40")
    assert (b.checkpoint_key, b.peer_key, b.own_key, b.peer_step) == ("ckpt/a40", "ckpt/a40", "ckpt/b30", 40)
    assert experts.checkpoint_keys(db, mixture) == {"0.0": "ckpt/a40"}
    # Host 1 stops calling: host 3 takes its replicas and restores the newest checkpoint of the expert.
    taken = renew(db, 3, mixture, "http://c:1", 100, at(1 + 31), grant=True)
    assert [(x.uid, x.replica, x.checkpoint_key) for x in taken] == [("0.0", 0, "ckpt/a40"), ("0.1", 0, None)]
