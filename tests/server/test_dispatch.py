"""Claiming work is atomic: simultaneous requests never get the same workunit."""

import threading

import httpx
import pytest
from sqlalchemy import func, select

from crowdtrain.jobspec import load_job_spec
from server.db import session_factory
from server.models import Assignment, Workunit
from server.states import AssignmentStatus, WorkunitStatus

from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
HOSTS = 200
SHARDS = 100


def register_hosts(cluster, n: int) -> list[str]:
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        return [http.post("/v1/hosts", json={"join_token": cluster.join_token, "name": f"h{i}"}).json()["host_token"]
                for i in range(n)]


def test_200_simultaneous_work_requests_on_postgresql_never_share_a_workunit(make_cluster, postgres_url) -> None:
    cluster = make_cluster(postgres_url, server_workers=2)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.dataset.subsets = SHARDS
    with cluster.admin() as http:
        job_id = http.post("/v1/jobs", json=spec.model_dump(mode="json")).json()["job_id"]
    tokens = register_hosts(cluster, HOSTS)
    barrier = threading.Barrier(HOSTS)
    replies: list[list[dict]] = [[] for _ in range(HOSTS)]
    errors: list[str] = []

    def ask(i: int) -> None:
        with httpx.Client(base_url=cluster.url, timeout=120,
                          headers={"Authorization": f"Bearer {tokens[i]}"}) as http:
            barrier.wait()
            resp = http.post("/v1/work", json={"free_slots": 1})
            if resp.status_code != 200:
                errors.append(f"{resp.status_code} {resp.text}")
            else:
                replies[i] = resp.json()["assignments"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(HOSTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]

    given = [a["workunit_id"] for r in replies for a in r]
    # Epoch 1's 100 workunits all go out; once none is ready, epoch 2 is released early and the
    # remaining requests draw from it. No epoch 3: epoch 1 is still open.
    assert len(given) == HOSTS
    assert len(set(given)) == len(given), "a workunit was given to two hosts"
    assert sorted({a["epoch"] for r in replies for a in r}) == [1, 2]
    db = session_factory(postgres_url)
    with db.begin() as s:
        per_wu = s.execute(select(Assignment.workunit_id, func.count()).where(Assignment.job_id == job_id)
                           .group_by(Assignment.workunit_id)).all()
        assert len(per_wu) == HOSTS and all(n == 1 for _, n in per_wu)
        assert s.scalar(select(func.count()).select_from(Workunit).where(Workunit.job_id == job_id)) == 2 * SHARDS
        assert s.scalar(select(func.count()).select_from(Workunit).where(
            Workunit.job_id == job_id, Workunit.status == WorkunitStatus.in_progress.value)) == HOSTS
        assert s.scalar(select(func.count()).select_from(Assignment).where(
            Assignment.job_id == job_id, Assignment.status == AssignmentStatus.in_progress.value)) == HOSTS
