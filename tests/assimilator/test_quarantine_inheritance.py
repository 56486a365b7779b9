"""A quarantine that re-registering does not end, through the real dispatch, upload and merge paths (no
Celery): a host quarantined for refused results registers again with the same join token, name and account
(or from the same network) and gets no work, with the low reputation it left with."""

import numpy as np
import pytest

from crowdtrain.assimilator.merge import MergeServices, Outcome, assimilate
from crowdtrain.core import keys
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.reputation import score
from crowdtrain.core.schemas import AssignmentOut, HostPublic, HostRegister, ResultMetrics
from crowdtrain.core.settings import Settings
from crowdtrain.core.tensors import decode
from crowdtrain.core.updates import encode_result
from crowdtrain.core.validationspec import ValidationSpec
from crowdtrain.server.services.dispatch import request_work
from crowdtrain.server.services.hosts import list_hosts, register_host
from crowdtrain.server.services.registration import RegistrationPolicy
from crowdtrain.server.services.results import store_result
from crowdtrain.workgen.generator import submit_job
from tests.conftest import EXAMPLE_SPEC

TOKEN = "join-token-for-this-test"


def register(services: MergeServices, name: str, account: str, address: str, *policy: RegistrationPolicy) -> int:
    """A host registered from `address` under the default policy (or the one given)."""
    req = HostRegister(join_token=TOKEN, name=name, account=account)
    return register_host(services.db, req, TOKEN, address, *policy).host_id


def work(services: MergeServices, host_id: int, slots: int) -> list[AssignmentOut]:
    return request_work(services.db, services.storage, host_id, slots, [], None)


def record(services: MergeServices, host_id: int) -> HostPublic:
    return next(h for h in list_hosts(services.db) if h.id == host_id)


def quarantined_host(services: MergeServices, address: str) -> int:
    """A host named mallory (account mallory) quarantined after two NaN results in a job that replicates nothing."""
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.validation = ValidationSpec(replicate_untrusted=False, quarantine_after=2)
    job_id = submit_job(services.db, services.storage, services.r, spec, Settings().upload_max_bytes).job_id
    upload = spec.assimilation.upload.model_dump()
    mallory = register(services, "mallory", "mallory", address)
    for _ in range(2):
        [a] = work(services, mallory, 1)
        base = decode(services.storage.get(keys.snapshot_key(job_id, a.base_version)))
        body = encode_result({k: np.full_like(v, np.nan) for k, v in base.items()}, base, upload)
        store_result(services.db, services.storage, mallory, job_id, a.assignment_id, body, ResultMetrics(), print)
        assert assimilate(services, a.assignment_id).outcome is Outcome.refused
    assert record(services, mallory).quarantined_until is not None
    return mallory


@pytest.mark.parametrize(
    ("name", "account", "address"),
    [("mallory", "mallory", "203.0.113.7"), ("fresh", "fresh", "203.0.113.8"), ("fresh", "mallory", "192.0.2.1")],
    ids=["same-token-name-account", "same-network", "same-account"],
)
def test_a_re_registered_host_stays_quarantined(services, name: str, account: str, address: str) -> None:
    first = record(services, quarantined_host(services, "203.0.113.7"))
    again = register(services, name, account, address)
    assert work(services, again, 2) == [], "the new host gets no work either"
    new = record(services, again)
    assert (new.quarantined_until, new.results_failed) == (first.quarantined_until, first.results_failed)
    assert new.reputation == pytest.approx(score(0, 2)) and new.reputation < 0.5
    assert first.quarantine_reason in new.quarantine_reason


def test_other_hosts_still_get_work(services) -> None:
    quarantined_host(services, "203.0.113.7")
    unrelated = register(services, "alice", "alice", "198.51.100.1")
    behind_the_same_nat = register(
        services, "bob", "bob", "203.0.113.9", RegistrationPolicy(quarantine_follows_network=False)
    )
    assert len(work(services, unrelated, 2)) == 2
    assert len(work(services, behind_the_same_nat, 2)) == 2
