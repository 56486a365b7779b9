"""The load generator's hosts with a workunit time (`simulate load --train-seconds`): each holds its
workunit that long before it uploads, heartbeating meanwhile as a client does, against a real
cluster (scheduler, transitioner, parameter server; SQLite)."""

from datetime import timedelta

import pytest
from sqlalchemy import select

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment
from crowdtrain.sim.load import simulate
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
TRAIN_SECONDS = 1.5
HEARTBEAT_SECONDS = 0.4


def test_hosts_hold_each_workunit_its_time_and_heartbeat_meanwhile(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url, extra_env={"CROWDTRAIN_HEARTBEAT_INTERVAL": str(HEARTBEAT_SECONDS)})
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.stop.target_accuracy, spec.stop.max_epochs = 1.0, 50
    job_id = cluster.submit(spec.model_dump(mode="json"))["job_id"]

    stats = simulate(cluster.url, cluster.join_token, hosts=2, duration=4.5, train_seconds=TRAIN_SECONDS)

    assert stats.uploads >= 2 and stats.server_errors == 0 and stats.refused == 0, stats.summary()
    # Each held workunit is beaten for every interval it is held (the last one may end the run first).
    assert stats.heartbeats >= stats.uploads * (int(TRAIN_SECONDS / HEARTBEAT_SECONDS) - 1), stats.summary()
    with session_factory(sqlite_url).begin() as s:
        uploaded = s.scalars(
            select(Assignment).where(Assignment.job_id == job_id, Assignment.uploaded_at.is_not(None))
        ).all()
        assert len(uploaded) == stats.uploads
        for a in uploaded:
            assert a.uploaded_at is not None and a.last_heartbeat is not None
            assert a.uploaded_at - a.sent_at >= timedelta(seconds=TRAIN_SECONDS), a.id
            assert a.sent_at < a.last_heartbeat < a.uploaded_at, a.id
