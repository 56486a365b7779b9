"""Registration in-process: limits per join token and per network over a sliding hour (429 with Retry-After,
nothing stored), join tokens issued to a volunteer account, and a quarantine that re-registering does not
end: it follows the account and the network."""

from datetime import timedelta

import pytest
from sqlalchemy import select

from crowdtrain.core.schemas import HostRegister
from crowdtrain.server.ledger.models import Host, utcnow
from crowdtrain.server.services.hosts import register_host
from crowdtrain.server.services.registration import RegistrationLimited, RegistrationPolicy
from tests.server.inprocess import Scheduler, ok, private_scheduler


def join(sched: Scheduler, name: str, address: str, token: str | None = None, account: str = ""):
    body = {"join_token": token or sched.settings.join_token, "name": name, "account": account}
    return sched.client(address=address).post("/v1/hosts", json=body)


def hosts(sched: Scheduler) -> dict[str, dict]:
    return {h["name"]: h for h in ok(sched.admin().get("/v1/admin/hosts")).json()}


def test_a_join_token_registers_at_most_its_limit_in_an_hour(tmp_path) -> None:
    with private_scheduler(tmp_path, registrations_per_hour_per_token=3) as sched:
        for i in range(3):
            ok(join(sched, f"h{i}", f"198.51.100.{i}"))
        before = sched.rows()
        refused = join(sched, "h3", "203.0.113.1")
        assert refused.status_code == 429, refused.text
        assert "the bootstrap join token registered 3 hosts in the last hour" in refused.json()["detail"]
        assert 3590 <= int(refused.headers["Retry-After"]) <= 3600
        assert sched.rows() == before, "a refused registration stores nothing"

        issued = ok(sched.admin().post("/v1/admin/join-tokens", json={"label": "lab", "registrations_per_hour": 1}))
        token = issued.json()["token"]
        ok(join(sched, "lab-1", "192.0.2.1", token))
        refused = join(sched, "lab-2", "192.0.2.2", token)
        assert refused.status_code == 429 and f"join token {issued.json()['id']} (lab)" in refused.json()["detail"]


def test_a_network_registers_at_most_its_limit_in_an_hour_whatever_the_token(tmp_path) -> None:
    with private_scheduler(tmp_path, registrations_per_hour_per_network=2) as sched:
        other = ok(sched.admin().post("/v1/admin/join-tokens", json={"label": "other"})).json()["token"]
        ok(join(sched, "a", "203.0.113.7"))
        ok(join(sched, "b", "::ffff:203.0.113.200", other))
        before = sched.rows()
        refused = join(sched, "c", "203.0.113.99", other)
        assert refused.status_code == 429, refused.text
        assert "network 203.0.113.0/24 registered 2 hosts in the last hour" in refused.json()["detail"]
        assert "Retry-After" in refused.headers
        assert sched.rows() == before
        ok(join(sched, "d", "203.0.114.1"))  # the next /24 is another network


def test_the_hour_slides_with_the_clock(tmp_path) -> None:
    policy = RegistrationPolicy(per_token=2, per_network=100)
    t0 = utcnow()
    with private_scheduler(tmp_path) as sched:
        token = sched.settings.join_token

        def register(name: str, minutes: float) -> int:
            req = HostRegister(join_token=token, name=name)
            return register_host(sched.db, req, token, "", policy, t0 + timedelta(minutes=minutes)).host_id

        register("a", 0)
        register("b", 30)
        with pytest.raises(RegistrationLimited) as refused:
            register("c", 59)
        assert refused.value.retry_after == 60
        register("c", 61)  # "a" left the hour
        with pytest.raises(RegistrationLimited):
            register("d", 62)


def test_a_token_issued_to_an_account_puts_its_hosts_under_it(tmp_path) -> None:
    with private_scheduler(tmp_path) as sched:
        body = {"label": "alice's machines", "account": "alice", "registrations_per_hour": 5}
        issued = ok(sched.admin().post("/v1/admin/join-tokens", json=body)).json()
        assert (issued["account"], issued["registrations_per_hour"]) == ("alice", 5)
        ok(join(sched, "laptop", "testclient", issued["token"]))
        ok(join(sched, "sock-puppet", "testclient", issued["token"], account="mallory"))
        ok(join(sched, "bob-pc", "testclient", account="bob"))  # a project-wide token: the host names its own
        accounts = {name: h["account"] for name, h in hosts(sched).items()}
        assert accounts == {"laptop": "alice", "sock-puppet": "alice", "bob-pc": "bob"}
        [listed] = ok(sched.admin().get("/v1/admin/join-tokens")).json()
        assert (listed["account"], listed["registrations_per_hour"], listed["hosts_registered"]) == ("alice", 5, 2)


def test_join_token_options_are_checked(tmp_path) -> None:
    with private_scheduler(tmp_path) as sched:
        before = sched.rows()
        for body in ({"label": "x", "registrations_per_hour": 0}, {"label": "x", "account": "a/b"}):
            resp = sched.admin().post("/v1/admin/join-tokens", json=body)
            assert resp.status_code == 422, resp.text
        assert sched.rows() == before


def quarantine(sched: Scheduler, name: str, hours: float = 24) -> Host:
    """Quarantine the host `name` as two refused results would (crowdtrain.server.ledger.reputation)."""
    with sched.db.begin() as s:
        host = s.scalars(select(Host).where(Host.name == name)).one()
        host.quarantined_until = utcnow() + timedelta(hours=hours)
        host.quarantine_reason = "2 results refused in a row; the last: invalid result: NaN"
        host.results_failed, host.consecutive_refused = 2, 2
        s.flush()
        s.expunge(host)
        return host


@pytest.mark.parametrize(
    ("again", "inherits"),
    [
        ({"name": "mallory", "address": "203.0.113.7", "account": "mallory"}, True),  # the same host again
        ({"name": "other-name", "address": "198.51.100.9", "account": "mallory"}, True),  # the account
        ({"name": "other-name", "address": "203.0.113.50", "account": "someone-else"}, True),  # the network
        ({"name": "mallory", "address": "198.51.100.9", "account": "someone-else"}, False),  # a name is no one's
    ],
)
def test_re_registering_does_not_end_a_quarantine(tmp_path, again: dict, inherits: bool) -> None:
    with private_scheduler(tmp_path) as sched:
        ok(join(sched, "mallory", "203.0.113.7", account="mallory"))
        first = quarantine(sched, "mallory")
        ok(join(sched, **again))
        with sched.db.begin() as s:
            new = s.scalars(select(Host).where(Host.token_hash != first.token_hash).order_by(Host.id.desc())).first()
            assert new is not None
            record = (new.quarantined_until, new.results_failed)
            reason = new.quarantine_reason
        assert record == ((first.quarantined_until, 2) if inherits else (None, 0))
        if inherits:
            assert reason == f"as host {first.id} of the same account or network: {first.quarantine_reason}"
            [shown] = [h for h in hosts(sched).values() if h["id"] == new.id]
            assert shown["reputation"] == pytest.approx(0.25)


def test_quarantine_follows_the_network_only_where_the_setting_says(tmp_path) -> None:
    with private_scheduler(tmp_path, quarantine_follows_network=False) as sched:
        ok(join(sched, "mallory", "203.0.113.7", account="mallory"))
        quarantine(sched, "mallory")
        ok(join(sched, "neighbour", "203.0.113.8", account="neighbour"))
        ok(join(sched, "mallory-2", "198.51.100.1", account="mallory"))
        shown = hosts(sched)
        assert shown["neighbour"]["quarantined_until"] is None, "a shared NAT does not share a quarantine"
        assert shown["mallory-2"]["quarantined_until"] is not None, "the account's quarantine still follows"


def test_an_ended_quarantine_is_not_inherited(tmp_path) -> None:
    with private_scheduler(tmp_path) as sched:
        ok(join(sched, "mallory", "203.0.113.7", account="mallory"))
        quarantine(sched, "mallory", hours=-1)
        ok(join(sched, "mallory-2", "203.0.113.7", account="mallory"))
        assert hosts(sched)["mallory-2"]["quarantined_until"] is None
