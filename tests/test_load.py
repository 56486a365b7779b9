"""500 simulated hosts hammer 3 scheduler workers and 2 parameter-server processes on PostgreSQL:
no workunit is held by two hosts at once (straggler duplicates off), no result is merged twice, no upload is lost."""

import json
import subprocess
import sys
from collections import defaultdict
from itertools import pairwise

import pytest
import redis
from sqlalchemy import select

from crowdtrain.core import keys
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import wait_for
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job, Workunit
from tests.conftest import EXAMPLE_SPEC
from tests.test_training_end_to_end import settle

pytestmark = pytest.mark.integration
HOSTS = 500


def job_status(db, job_id: int) -> str:
    with db.begin() as s:
        return s.get_one(Job, job_id).status


def test_500_simulated_hosts_on_postgresql(make_cluster, postgres_url: str) -> None:
    cluster = make_cluster(postgres_url, server_workers=3, assimilator_concurrency=2)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.dataset.subsets = 50
    # Never met: the job runs its 2 epochs, 100 workunits, so 500 hosts contend for every claim and one epoch release.
    spec.stop.target_accuracy = 1.0
    spec.stop.max_epochs = 2
    spec.scheduling.deadline_seconds = 20  # a result lost to a refused request is re-dispatched soon
    # No straggler duplicates: this test holds that concurrent claims never give one workunit to two hosts.
    spec.scheduling.duplicate_after_seconds = None
    with cluster.admin() as http:
        job_id = http.post("/v1/jobs", json=spec.model_dump(mode="json")).json()["job_id"]
    # The hosts ask for work until the job has run its 2 epochs; then SIGTERM ends the simulation,
    # which still prints its figures. (A fixed idle window to end it would be too short on a loaded
    # machine, where an epoch's close can take long, and wasted time on a quiet one.)
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "crowdtrain",
            "simulate",
            "--server",
            cluster.url,
            "--join-token",
            cluster.join_token,
            "--hosts",
            str(HOSTS),
            "--duration",
            "540",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cluster.env,
    )
    db = session_factory(postgres_url)
    try:
        wait_for(lambda: job_status(db, job_id) != "running" or sim.poll() is not None, 540, "the job never ended")
    finally:
        sim.terminate()
        out, err = sim.communicate(timeout=300)  # 500 hosts' last requests end first; minutes when another suite runs
    assert sim.returncode == 0, err[-3000:]
    figures = json.loads(out.strip().splitlines()[-1])
    print("load:", json.dumps(figures))
    assert figures["dispatched"] >= 100 and figures["server_errors"] == 0

    settle(cluster, db)
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert job.status == "failed" and "max_epochs=2" in job.status_message, job.status_message
        assert {wu.status for wu in s.scalars(select(Workunit).where(Workunit.job_id == job_id))} <= {"done", "failed"}
        assignments = s.scalars(
            select(Assignment).where(Assignment.job_id == job_id).order_by(Assignment.sent_at)
        ).all()
    by_wu = defaultdict(list)
    for a in assignments:
        by_wu[a.workunit_id].append(a)
    double_dispatch = sum(
        1
        for runs in by_wu.values()
        for prev, nxt in pairwise(runs)
        if prev.finished_at is None or nxt.sent_at < prev.finished_at
    )
    double_merge = sum(1 for runs in by_wu.values() if sum(a.status == "merged" for a in runs) > 1)
    lost = sum(1 for a in assignments if a.uploaded_at is not None and a.status not in ("merged", "rejected"))
    print(f"double dispatch {double_dispatch}, double merge {double_merge}, lost uploads {lost}")
    assert (double_dispatch, double_merge, lost) == (0, 0, 0)
    r = redis.Redis.from_url(cluster.redis_url)
    merged = {str(a.id) for a in assignments if a.status == "merged"}
    assert {m.decode() for m in r.smembers(keys.merged(job_id))} == merged
    assert figures["uploads"] == sum(1 for a in assignments if a.uploaded_at is not None)
