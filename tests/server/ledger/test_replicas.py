"""Replica spread (crowdtrain.server.ledger.replicas.claim_replicas) through the real work route: a
replica never goes to a host on the network of a live holder, as it never goes to the same account."""

from crowdtrain.core.jobspec import load_job_spec
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, private_scheduler


def _replicated_job() -> dict:
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["validation"] = {"replicate_untrusted": True}
    spec["scheduling"]["duplicate_after_seconds"] = None
    return spec


def test_a_replica_never_goes_to_a_host_on_the_network_of_a_live_holder(tmp_path) -> None:
    with private_scheduler(tmp_path) as sched:
        ok(sched.admin().post("/v1/jobs", json=_replicated_job()))
        first = sched.register("first", address="198.51.100.7", account="alice")
        neighbour = sched.register("neighbour", address="198.51.100.99", account="bob")
        other_loopback = sched.register("loopback-2", address="127.0.2.1", account="carol")
        unknown = sched.register("unknown", address="testclient", account="dave")
        unknown_too = sched.register("unknown-too", address="testclient", account="erin")

        def work(host) -> list[int]:
            return [a["workunit_id"] for a in ok(host.post("/v1/work", json={"free_slots": 1})).json()["assignments"]]

        [held] = work(first)
        [given] = work(neighbour)
        assert given != held, "another account on the holder's /24 gets no replica of its workunit"
        [replica] = work(other_loopback)
        assert replica == held, "a host on another network (a loopback address is its own) takes the replica"

        [second] = work(unknown)
        assert second == given, "a host of unknown network takes the replica of one on a known network"
        [third] = work(unknown_too)
        assert third not in (held, given)
        [replica_of_unknown] = work(sched.register("unknown-3", address="testclient", account="frank"))
        assert replica_of_unknown == third, "hosts of unknown networks are not taken to share one"
