"""The whole system as real processes: scheduler, Redis, Celery parameter servers, transitioner, clients."""

import signal
import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.core import keys
from crowdtrain.core.assimilationspec import UploadSpec
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.modelfile import read_metadata
from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.core.tensors import decode
from crowdtrain.core.updates import upload_sizes
from crowdtrain.launch.cluster import Cluster, wait_for
from crowdtrain.launch.scripted_host import ScriptedHost
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host, Job, Workunit
from crowdtrain.workgen.datasets import load_dataset
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
JOB_TIMEOUT = 420


def submit(cluster: Cluster, **scheduling) -> int:
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.scheduling = spec.scheduling.model_copy(update=scheduling)
    with cluster.admin() as http:
        resp = http.post("/v1/jobs", json=spec.model_dump(mode="json"))
        assert resp.status_code == 201, resp.text
        return resp.json()["job_id"]


def job_status(http: httpx.Client, job_id: int) -> dict:
    """GET is idempotent: asked again once if the pooled connection it went on was closed under it."""
    try:
        resp = http.get(f"/v1/jobs/{job_id}")
    except httpx.TransportError:
        resp = http.get(f"/v1/jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_finished(cluster: Cluster, job_id: int, timeout: float = JOB_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    with cluster.admin() as http:
        while time.monotonic() < deadline:
            st = job_status(http, job_id)
            if st["status"] in ("succeeded", "failed", "cancelled"):
                return st
            dead = [s.name for s in cluster.services if not s.alive]
            assert not dead, f"processes died: {dead}\n" + "\n".join(cluster.service(n).tail() for n in dead)
            time.sleep(1)
    pytest.fail(f"job {job_id} did not finish within {timeout}s: {st}")


def settle(cluster: Cluster, db) -> None:
    """Stop the clients and wait until every uploaded result has been merged or rejected."""
    for client in cluster.clients:
        client.stop()

    def nothing_in_flight() -> bool:
        with db.begin() as s:
            return not s.scalar(
                select(func.count()).select_from(Assignment).where(Assignment.status == AssignmentStatus.uploaded.value)
            )

    # A lost merge is re-queued by the transitioner within 2 x stuck_upload_seconds (60 s by default).
    wait_for(nothing_in_flight, 150, "uploaded results were never merged or rejected")


def assert_exact_accounting(cluster: Cluster, job_id: int) -> None:
    """Every workunit of every closed epoch is done or failed; nothing merged twice (DB and Redis agree)."""
    db = session_factory(cluster.database_url or f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
    settle(cluster, db)
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        wus = s.scalars(select(Workunit).where(Workunit.job_id == job_id)).all()
        finished = {WorkunitStatus.done.value, WorkunitStatus.failed.value}
        assert all(wu.status in finished | {WorkunitStatus.cancelled.value} for wu in wus), "work left open"
        # Only epochs still open when the job ended are cancelled (the next, released early, or an
        # older one whose straggler was still running), never the one that met the target.
        open_epochs = {wu.epoch for wu in wus if wu.status == WorkunitStatus.cancelled.value}
        if job.status == "succeeded":
            assert int(job.status_message.split()[1]) not in open_epochs
        merged_per_wu = s.execute(
            select(Assignment.workunit_id, func.count())
            .where(Assignment.job_id == job_id, Assignment.status == AssignmentStatus.merged.value)
            .group_by(Assignment.workunit_id)
        ).all()
        assert all(n == 1 for _, n in merged_per_wu), "a workunit was merged twice"
        done = {wu.id for wu in wus if wu.status == WorkunitStatus.done.value}
        merged_wus = {wu_id for wu_id, _ in merged_per_wu}
        assert done <= merged_wus, "a workunit is done without a merged assignment"
        # A merge racing with the job's end lands in W_s after its open epoch's workunit was cancelled.
        for wu in wus:
            if wu.id in merged_wus - done:
                assert wu.status == WorkunitStatus.cancelled.value, (wu.id, wu.status)
        merged_ids = {
            str(a)
            for a in s.scalars(
                select(Assignment.id).where(
                    Assignment.job_id == job_id, Assignment.status == AssignmentStatus.merged.value
                )
            )
        }
    r = redis.Redis.from_url(cluster.redis_url)
    assert {m.decode() for m in r.smembers(keys.merged(job_id))} == merged_ids
    assert int(r.get(keys.version(job_id))) == len(merged_ids), "W_s version != number of merged assignments"


def assert_metrics_agree(cluster: Cluster, job_id: int) -> None:
    """/metrics (Prometheus text) counts what the database counts (call after `settle`)."""
    assert httpx.get(f"{cluster.url}/metrics").status_code == 401
    with cluster.admin() as http:
        text = http.get("/metrics").text
        assignments = http.get(f"/v1/jobs/{job_id}").json()["assignments"]
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    merges = assignments.get("merged", 0)
    assert samples["crowdtrain_merges_total"] == merges
    assert samples["crowdtrain_merge_latency_seconds_count"] == merges
    assert samples["crowdtrain_uploads_total"] >= merges
    assert samples["crowdtrain_dispatches_total"] == sum(assignments.values())
    assert samples["crowdtrain_work_requests_total"] >= 1


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
def test_two_clients_train_the_example_job_to_its_target(make_cluster, database_url: str) -> None:
    cluster = make_cluster(database_url)
    job_id = submit(cluster)
    cluster.start_client("alice", tasks=2)
    cluster.start_client("bob", tasks=2)
    st = wait_finished(cluster, job_id)
    assert st["status"] == "succeeded", st["status_message"]
    assert max(e["mean_accuracy"] or 0 for e in st["epochs"]) >= 0.90
    assert_exact_accounting(cluster, job_id)
    assert_metrics_agree(cluster, job_id)
    with cluster.admin() as http:
        model = http.get(f"/v1/jobs/{job_id}/model")
        job = http.get(f"/v1/jobs/{job_id}").json()
    assert model.status_code == 200
    # The exported model is the trained W_s: evaluated here, it is as good as the server said.
    data = load_dataset("builtin:mnist1d")
    spec = load_job_spec(EXAMPLE_SPEC)
    _, accuracy = evaluate(
        0,
        {
            "name": spec.model.name,
            "input_shape": data.input_shape,
            "num_classes": data.num_classes,
            "options": spec.model.options,
        },
        decode(model.content),
        data.x_val,
        data.y_val,
    )
    assert accuracy >= 0.85
    assert accuracy == pytest.approx(job["final_accuracy"], abs=0.03)
    meta = read_metadata(model.content)  # and it says what it is
    assert (meta["job_id"], meta["model_name"], meta["framework"]) == (str(job_id), spec.model.name, "pytorch")
    assert float(meta["val_accuracy"]) == job["final_accuracy"]


def test_sigkilled_client_work_is_redispatched_after_its_deadline(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url)
    deadline_s = 8
    job_id = submit(cluster, deadline_seconds=deadline_s)
    db = session_factory(sqlite_url)
    victim = cluster.start_client("victim", tasks=2)

    def victim_is_training() -> bool:
        with db.begin() as s:
            return bool(
                s.scalar(
                    select(func.count())
                    .select_from(Assignment)
                    .join(Host)
                    .where(Host.name == "victim", Assignment.status == AssignmentStatus.in_progress.value)
                )
            )

    wait_for(victim_is_training, 120, "the victim never got work", victim)
    victim.signal(signal.SIGKILL)
    with db.begin() as s:
        lost = s.scalars(
            select(Assignment)
            .join(Host)
            .where(Host.name == "victim", Assignment.status == AssignmentStatus.in_progress.value)
        ).all()
        lost = [(a.id, a.workunit_id, a.deadline) for a in lost]
    assert lost
    cluster.start_client("survivor", tasks=2)
    st = wait_finished(cluster, job_id)
    assert st["status"] == "succeeded", st["status_message"]
    assert_exact_accounting(cluster, job_id)
    with db.begin() as s:
        for aid, wu_id, deadline in lost:
            a = s.get_one(Assignment, aid)
            assert a.status == AssignmentStatus.timed_out.value, (aid, a.status)
            retry = s.scalars(
                select(Assignment).where(Assignment.workunit_id == wu_id, Assignment.id != aid).order_by(Assignment.id)
            ).first()
            assert retry is not None, f"workunit {wu_id} was never dispatched again"
            assert retry.sent_at >= deadline, "re-dispatched before the lost assignment's deadline"
            assert s.get_one(Workunit, wu_id).status in (WorkunitStatus.done.value, WorkunitStatus.failed.value)


def test_int8_delta_uploads_train_the_example_job_to_its_target(make_cluster, sqlite_url: str) -> None:
    """Clients upload Δ = W_c − W_base as int8 with a scale per 64 values, and the parameter servers
    merge W_base + Δ̂ (vc-asgd): the job reaches its target, every upload taking under 0.3 of the
    float32 weights' bytes (counted by /metrics as received)."""
    cluster = make_cluster(sqlite_url)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.assimilation.upload = UploadSpec(send="delta", dtype="int8", block_size=64)
    job_id = cluster.submit(spec.model_dump(mode="json"))["job_id"]
    cluster.start_client("alice", tasks=2)
    cluster.start_client("bob", tasks=2)
    st = wait_finished(cluster, job_id)
    assert st["status"] == "succeeded", st["status_message"]
    assert_exact_accounting(cluster, job_id)
    with session_factory(sqlite_url).begin() as s:
        job = s.get_one(Job, job_id)
        manifest, weights_bytes = job.param_manifest, job.param_bytes
    with cluster.admin() as http:
        samples = {
            s.name: s.value for fam in text_string_to_metric_families(http.get("/metrics").text) for s in fam.samples
        }
    per_upload = samples["crowdtrain_upload_bytes_total"] / samples["crowdtrain_uploads_total"]
    assert per_upload == upload_sizes(manifest, (spec.assimilation.upload.model_dump(),))["delta/int8/block64"]
    assert per_upload <= 0.3 * weights_bytes


def test_class_sorted_data_dealt_anew_each_epoch_trains_with_dynamic_local_work(
    make_cluster, sqlite_url: str, tmp_path
) -> None:
    """mnist1d sorted by class, as a file may be: contiguous slices (shuffle none) stay near 0.27
    accuracy after 10 epochs; stratified shards, re-dealt every epoch, pass 0.7 by epoch 3."""
    import numpy as np

    from crowdtrain.server.ledger.models import Shard

    data = load_dataset("builtin:mnist1d")
    order = np.argsort(data.y, kind="stable")
    np.savez(tmp_path / "sorted.npz", x=data.x[order], y=data.y[order], x_val=data.x_val, y_val=data.y_val)
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["dataset"].update(source=f"npz:{tmp_path / 'sorted.npz'}", shuffle="stratified", reshuffle_each_epoch=True)
    spec["training"].update(dynamic_local_work=True, min_local_fraction=0.5)
    spec["stop"].update(target_accuracy=0.7, max_epochs=8)
    cluster = make_cluster(sqlite_url)
    job_id = cluster.submit(spec)["job_id"]
    cluster.start_client("alice", tasks=2)
    cluster.start_client("bob", tasks=2)
    st = wait_finished(cluster, job_id)
    assert st["status"] == "succeeded", st["status_message"]
    with session_factory(sqlite_url).begin() as s:
        shard_epochs = s.execute(
            select(Shard.epoch, func.count(), func.count(Shard.sha256))
            .where(Shard.job_id == job_id)
            .group_by(Shard.epoch)
        ).all()
        fractions = s.scalars(
            select(Assignment.local_fraction).where(
                Assignment.job_id == job_id, Assignment.status == AssignmentStatus.merged.value
            )
        ).all()
    # Epoch 1 trains on the deal made at submission; each later epoch on its own, all written.
    assert {e for e, _, _ in shard_epochs} == {0} | set(range(2, max(e for e, _, _ in shard_epochs) + 1))
    assert all(n == written == 4 for e, n, written in shard_epochs if e <= st["current_epoch"] - 1)
    assert all(0.5 <= f <= 1.0 for f in fractions) and 1.0 in fractions


def test_an_idle_client_duplicates_the_straggler_and_the_first_result_wins(make_cluster, sqlite_url: str) -> None:
    """A one-epoch job of 4 workunits: a scripted host takes one and sits on it. A real client trains
    the other three, then, with nothing else to give, a duplicate of the straggler's workunit; its
    result is merged and closes the job. The straggler is told to stop and its late upload refused;
    the workunit is done once and nothing is merged twice."""
    cluster = make_cluster(sqlite_url)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.stop.max_epochs, spec.stop.target_accuracy = 1, 0.05
    spec.scheduling = spec.scheduling.model_copy(update={"duplicate_after_seconds": 1.0})
    job_id = cluster.submit(spec.model_dump(mode="json"))["job_id"]
    straggler = ScriptedHost(cluster.url, cluster.join_token, "straggler")
    held = straggler.next_assignment()
    cluster.start_client("alice", tasks=1)
    st = wait_finished(cluster, job_id, timeout=120)
    assert st["status"] == "succeeded", st["status_message"]

    beat = straggler.http.post(f"/v1/assignments/{held['assignment_id']}/heartbeat").json()
    assert beat == {"keep_going": False, "reason": "assignment is superseded", "deadline": None}
    late = straggler.http.put(f"/v1/assignments/{held['assignment_id']}/result", content=b"a late result")
    assert late.status_code == 409, late.text
    assert_exact_accounting(cluster, job_id)
    db = session_factory(sqlite_url)
    with db.begin() as s:
        runs = s.execute(
            select(Assignment.status, Host.name).join(Host).where(Assignment.workunit_id == held["workunit_id"])
        ).all()
        assert sorted(runs) == [("merged", "alice"), ("superseded", "straggler")]
        assert s.scalar(select(func.count()).select_from(Assignment).where(Assignment.job_id == job_id)) == 5
        assert s.scalar(select(Host.results_failed).where(Host.name == "straggler")) == 0
        merged_workunits = s.scalars(
            select(Assignment.workunit_id).where(Assignment.job_id == job_id, Assignment.status == "merged")
        ).all()
    assert len(merged_workunits) == len(set(merged_workunits)) == 4, "one merge per workunit"
    r = redis.Redis.from_url(cluster.redis_url)
    assert int(r.get(keys.version(job_id))) == 4 == r.scard(keys.merged(job_id))
    assert not r.exists(keys.merged_workunits(job_id)), "only merges read it: it ends with the job"
