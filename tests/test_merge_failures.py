"""A merge that can never succeed ends its assignment and, when the cause is the job's own, the job:
real scheduler, Celery parameter server and transitioner processes."""

import time

import numpy as np
import pytest
from sqlalchemy import select

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.tensors import encode_shard
from crowdtrain.launch.cluster import wait_for
from crowdtrain.launch.scripted_host import ScriptedHost
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
STUCK_UPLOAD_S = 2.0  # the transitioner queues a merge again this long after its upload


def test_a_job_whose_validation_set_does_not_fit_its_model_fails_and_names_the_cause(make_cluster, sqlite_url) -> None:
    cluster = make_cluster(sqlite_url, extra_env={"CROWDTRAIN_STUCK_UPLOAD_SECONDS": str(STUCK_UPLOAD_S)})
    job_id = cluster.submit(load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))["job_id"]
    # Submission checks the dataset; break it afterwards: 100 validation examples but 60 labels.
    rng = np.random.default_rng(0)
    (cluster.var_dir / "storage" / "jobs" / str(job_id) / "validation.npz").write_bytes(
        encode_shard(rng.standard_normal((100, 40)).astype(np.float32), np.arange(60) % 10)
    )
    host = ScriptedHost(cluster.url, cluster.join_token, "alice")
    work = host.next_assignment()
    w_c = {  # a valid, harmless result: W_base moved a little (W_base itself is refused: no training)
        k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
        for k, v in host.snapshot(work).items()
    }
    assert host.upload(work, w_c).status_code == 202

    db = session_factory(sqlite_url)
    # The first merge waits for the parameter server to import torch: 20-30 s on 2 busy cores.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with db.begin() as s:
            job = s.get_one(Job, job_id)
            status, message = job.status, job.status_message
        if status != "running":
            break
        time.sleep(0.5)
    assert status == "failed", f"the job is still {status}"
    assert "validation set" in message and "W_s" in message, message
    # Until then the transitioner may well have queued the slow merge again (it is stalled after
    # STUCK_UPLOAD_S); from now on it must not: the result is ended, and the job no longer runs.
    log_path = cluster.var_dir / "logs" / "transitioner.log"
    wait_for(
        lambda: "transitioner running every" in log_path.read_text(),
        120,
        "the transitioner did not start",
        cluster.service("transitioner"),
    )
    time.sleep(STUCK_UPLOAD_S)  # a sweep that read the result before the job failed has logged it by now
    failed_at = log_path.stat().st_size
    time.sleep(2.5 * STUCK_UPLOAD_S)  # two more sweeps that queue stalled merges again
    with db.begin() as s:
        statuses = s.scalars(select(Assignment.status).where(Assignment.job_id == job_id)).all()
    assert AssignmentStatus.uploaded.value not in statuses
    with log_path.open("rb") as f:
        f.seek(failed_at)
        assert "queueing its merge again" not in f.read().decode(errors="replace")
