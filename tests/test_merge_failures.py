"""A merge that can never succeed ends its assignment and, when the cause is the job's own, the job:
real scheduler, Celery parameter server and transitioner processes."""

import time

import numpy as np
import pytest
from sqlalchemy import select

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.tensors import encode_shard
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job
from tests.conftest import EXAMPLE_SPEC
from tests.http_host import ScriptedHost

pytestmark = pytest.mark.integration


def test_a_job_whose_validation_set_does_not_fit_its_model_fails_and_names_the_cause(make_cluster, sqlite_url) -> None:
    cluster = make_cluster(sqlite_url, extra_env={"CROWDTRAIN_STUCK_UPLOAD_SECONDS": "2"})
    job_id = cluster.submit(load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))["job_id"]
    # Submission checks the dataset; break it afterwards: 100 validation examples but 60 labels.
    rng = np.random.default_rng(0)
    (cluster.var_dir / "storage" / "jobs" / str(job_id) / "validation.npz").write_bytes(
        encode_shard(rng.standard_normal((100, 40)).astype(np.float32), np.arange(60) % 10)
    )
    host = ScriptedHost(cluster.url, cluster.join_token, "alice")
    work = host.next_assignment()
    assert host.upload(work, host.snapshot(work)).status_code == 202  # a valid, harmless result

    db = session_factory(sqlite_url)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with db.begin() as s:
            job = s.get_one(Job, job_id)
            status, message = job.status, job.status_message
        if status != "running":
            break
        time.sleep(0.5)
    assert status == "failed", f"the job is still {status}"
    assert "validation set" in message and "W_s" in message, message
    time.sleep(5)  # two transitioner sweeps with stuck_upload_seconds=2: nothing is queued again
    with db.begin() as s:
        statuses = s.scalars(select(Assignment.status).where(Assignment.job_id == job_id)).all()
    assert AssignmentStatus.uploaded.value not in statuses
    log = (cluster.var_dir / "logs" / "transitioner.log").read_text()
    assert "queueing its merge again" not in log
