"""Every stage of a merge is stamped, in order, from the upload's body in hand at the scheduler to W_s
written, and the merge log keeps the stamps (what benchmarks/merge_latency.py breaks a merge's time
into): an upload over HTTP to the in-process scheduler, its merge task's stamps taken from the queue
it was handed to, and the merge run as the task runs it."""

import json

import numpy as np
import pytest
import redis

from crowdtrain.assimilator.merge import MergeServices, Outcome
from crowdtrain.assimilator.merge_pass import merge_queued
from crowdtrain.core import keys, merge_stages
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.storage import open_storage
from crowdtrain.core.tensors import decode, encode
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, scheduler_app


def test_a_merge_stamps_every_stage_in_order_and_its_log_entry_keeps_them(tmp_path, private_redis: redis.Redis) -> None:
    queued: list[tuple[int, merge_stages.Stamps]] = []
    with scheduler_app(tmp_path / "var", private_redis) as sched:
        sched.app.state.clients.merge_queue = lambda assignment_id, stamps: queued.append((assignment_id, stamps))
        admin = sched.admin()
        job_id = ok(admin.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))).json()["job_id"]
        host = sched.register("h1")
        [a] = ok(host.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
        snapshot = decode(host.get(a["snapshot"]["url"]).content)
        rng = np.random.default_rng(0)  # a trained-looking update: not one constant step
        result = {
            k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in snapshot.items()
        }
        ok(host.put(f"/v1/assignments/{a['assignment_id']}/result", content=encode(result)))

        [(assignment_id, sent)] = queued
        stamps = merge_stages.of_task(json.loads(json.dumps(sent)))  # as the task's message carries them
        merge_stages.stamp(stamps, "started")
        services = MergeServices(sched.db, open_storage(sched.settings.resolved_storage_url), private_redis, 3)
        assert merge_queued(services, assignment_id, stamps).outcome is Outcome.merged

    entry = json.loads(private_redis.hget(keys.merge_log(job_id), str(assignment_id)))
    logged = entry["stamps"]
    assert list(sent) == ["received", "checked", "stored", "recorded", "queued"], "the scheduler's stages"
    assert set(logged) == set(merge_stages.STAGES)
    times = [logged[stage] for stage in merge_stages.STAGES]
    assert times == sorted(times), f"stamped out of order: {logged}"
    assert (entry["received_at"], entry["merged_at"]) == (logged["received"], logged["merged"])
    assert sum(merge_stages.spans(logged).values()) == pytest.approx(entry["merged_at"] - entry["received_at"])
