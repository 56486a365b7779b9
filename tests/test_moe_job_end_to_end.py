"""A mode moe job end to end, from the example spec: three expert host processes lease the job's
mixture; a volunteer client trains the job's dense trunk through them, workunit by workunit; the
parameter servers merge the trunk and evaluate it with the experts' checkpoints. One host is
SIGKILLed mid-run; its experts are leased again and restored, and the job still reaches its target."""

import os
import signal
import subprocess
import sys
import time

import pytest

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.tensors import decode
from crowdtrain.launch.cluster import wait_for
from tests.conftest import ROOT
from tests.test_training_end_to_end import job_status, wait_finished

pytestmark = pytest.mark.integration

SPEC = ROOT / "examples" / "clusters-moe.yaml"


def test_a_moe_job_trains_to_its_target_through_expert_hosts_while_one_is_killed(make_cluster, sqlite_url) -> None:
    spec = load_job_spec(SPEC)
    assert spec.experts is not None
    cluster = make_cluster(sqlite_url)
    job_id = cluster.submit(spec.model_dump(mode="json"))["job_id"]
    with cluster.admin() as http:
        mixture = job_status(http, job_id)["mixture_id"]
        assert mixture is not None
        hosts = [cluster.start_expert_host(f"host{i}", mixture, 16) for i in range(3)]
        experts = spec.experts.layers * spec.experts.experts_per_layer

        def leased() -> dict[str, str]:
            view = http.get(f"/v1/mixtures/{mixture}").json()["experts"]
            return {e["uid"]: e["url"] for e in view if e["url"] is not None}

        wait_for(lambda: len(leased()) == experts, 120, "the experts were not all leased", hosts[0][0])
        cluster.start_client("trainer", tasks=1)
        # Kill a host once the trunk has been merged a few times and its experts have checkpoints.
        wait_for(lambda: job_status(http, job_id)["merges"] >= 3, 300, "no merges", cluster.service("trainer"))
        killed_url = hosts[2][1]
        orphans = sorted(uid for uid, url in leased().items() if url == killed_url)
        hosts[2][0].signal(signal.SIGKILL)
        hosts[2][0].proc.wait(30)
        killed_at = time.monotonic()
        wait_for(
            lambda: killed_url not in leased().values() and len(leased()) == experts, 60, "not re-leased", hosts[0][0]
        )
        moved_after = time.monotonic() - killed_at
        st = wait_finished(cluster, job_id)
        assert st["status"] == "succeeded", (st["status_message"], cluster.service("trainer").tail())
        assert st["final_accuracy"] >= spec.stop.target_accuracy
        view = {e["uid"]: e for e in http.get(f"/v1/mixtures/{mixture}").json()["experts"]}
        model = http.get(f"/v1/jobs/{job_id}/model")
        assert model.status_code == 200, model.text
    # The exported model is the whole model: the trunk, and the weights of every expert's last checkpoint.
    tensors = decode(model.content)
    checkpointed = {uid for uid, e in view.items() if e["checkpoint_step"] > 0}
    assert checkpointed and {name.split("/")[1] for name in tensors if name.startswith("expert/")} == checkpointed
    assert {"embed.weight", "head.1.weight"} <= set(tensors)
    # The killed host's experts moved to the living hosts, within the lease and a heartbeat or two.
    assert orphans and all(view[uid]["leases"] >= 2 for uid in orphans)
    lease = spec.experts.heartbeat_seconds * spec.experts.lease_heartbeats
    assert moved_after < lease + 10 * spec.experts.heartbeat_seconds, moved_after
    # The trunk was trained by the volunteer and merged: results of several workunits, each merged once.
    assert st["merges"] >= 6 and st["assignments"].get("merged") == st["merges"]
    # The operator's view of the job shows where its experts are served.
    env = {**os.environ, "CROWDTRAIN_ADMIN_TOKEN": cluster.admin_token, "COLUMNS": "200"}
    shown = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "job", "status", str(job_id), "--server", cluster.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"mixture {mixture} 'clusters-moe'" in shown.stdout and f"{experts} of {experts} served" in shown.stdout
    assert all(uid in shown.stdout for uid in view)
