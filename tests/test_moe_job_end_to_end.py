"""A mode moe job end to end, from the example spec on MNIST-like data (mnist1d, two mixture layers of
4x4 experts, top 4): expert host processes lease the job's mixture; a
volunteer client trains the job's dense trunk through them, workunit by workunit; the parameter
servers merge the trunk and evaluate it with the experts' checkpoints. Among the hosts is a hostile
one, leasing like any other but answering with NaN: the trainer refuses its answers and reports them,
the scheduler charges it until it is quarantined, and its experts move on. Then an honest host is
SIGKILLed mid-run: its experts are leased again and restored. The job still reaches its target, and
its exported model carries the experts. The trunk alone does not reach that target."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from crowdtrain.client.experts.leasing import MixtureAPI
from crowdtrain.client.server_http import Refused
from crowdtrain.core.experts import FORWARD_ARGS, encode_call, read_call
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.tensors import decode
from crowdtrain.launch.cluster import wait_for
from crowdtrain.workgen.datasets import load_dataset
from tests.client.experts.trunk import trunk_alone
from tests.conftest import ROOT
from tests.stub_http import OK, stub_server
from tests.test_training_end_to_end import job_status, wait_finished

pytestmark = pytest.mark.integration

SPEC = ROOT / "examples" / "mnist1d-moe.yaml"
HOSTILE_CAPACITY = 8


def test_the_trunk_alone_stays_below_the_example_target() -> None:
    """The job's model with no expert to call (each mixture layer passes its input on), trained far
    longer than the job below needs: what the experts add is what reaching the target takes."""
    spec = load_job_spec(SPEC)
    assert spec.experts is not None
    data = load_dataset(spec.dataset.source)
    reached, dropped = trunk_alone(
        spec.experts,
        data.input_shape,
        data.num_classes,
        (data.x, data.y),
        (data.x_val, data.y_val),
        steps=4000,
        batch=spec.training.batch_size,
        lr=spec.training.lr,
    )
    assert reached < spec.stop.target_accuracy - 0.08
    assert dropped > 0


@pytest.fixture
def hostile_url() -> Iterator[str]:
    """An expert host that passes the scheduler's connect-back probe and answers every call with NaN."""
    layout = load_job_spec(SPEC).experts
    assert layout is not None

    def nan_answers(method: str, _path: str, body: bytes) -> tuple[int, bytes]:
        if method == "GET":
            return OK
        rows = read_call(body, FORWARD_ARGS, layout.dim, 1 << 16)["x"].shape[0]
        return 200, encode_call(y=np.full((rows, layout.dim), np.nan))

    with stub_server(nan_answers) as url:
        yield url


@pytest.mark.timeout(1800)  # the job runs about 10 epochs: 2 minutes on a quiet machine, more under load
def test_a_moe_job_reaches_its_target_through_a_hostile_host_and_a_killed_one(
    make_cluster, sqlite_url, hostile_url
) -> None:
    spec = load_job_spec(SPEC)
    assert spec.experts is not None
    cluster = make_cluster(sqlite_url)
    job_id = cluster.submit(spec.model_dump(mode="json"))["job_id"]
    stop = threading.Event()
    with cluster.admin() as http:
        mixture = job_status(http, job_id)["mixture_id"]
        assert mixture is not None

        def leased() -> dict[str, str]:
            view = http.get(f"/v1/mixtures/{mixture}").json()["experts"]
            return {e["uid"]: e["url"] for e in view if e["url"] is not None}

        # The hostile host leases first, then three honest ones take the rest.
        hostile = MixtureAPI(cluster.url, stop=stop)
        hostile.register(cluster.join_token, "hostile")
        held = {lease.uid for lease in hostile.lease(mixture, hostile_url, HOSTILE_CAPACITY).leases}

        def beat() -> None:  # it renews its leases for as long as the scheduler lets it
            while not stop.wait(spec.experts.heartbeat_seconds):
                with contextlib.suppress(Refused):
                    hostile.lease(mixture, hostile_url, HOSTILE_CAPACITY)

        threading.Thread(target=beat, daemon=True).start()
        hosts = [cluster.start_expert_host(f"host{i}", mixture, 16) for i in range(3)]
        experts = spec.experts.layers * spec.experts.experts_per_layer
        wait_for(lambda: len(leased()) == experts, 120, "the experts were not all leased", hosts[0][0])
        cluster.start_client("trainer", tasks=1)
        try:
            # The trainer's reports charge the hostile host; 5 refused answers in a row quarantine it and
            # free its experts, which the honest hosts lease.
            wait_for(lambda: hostile_url not in leased().values(), 240, "the hostile host kept its experts")
            # Kill an honest host once the trunk has been merged a few times and its experts checkpointed.
            wait_for(lambda: job_status(http, job_id)["merges"] >= 3, 300, "no merges", cluster.service("trainer"))
            killed_url = hosts[2][1]
            orphans = sorted(uid for uid, url in leased().items() if url == killed_url)
            hosts[2][0].signal(signal.SIGKILL)
            hosts[2][0].proc.wait(30)
            killed_at = time.monotonic()
            wait_for(lambda: killed_url not in leased().values() and len(leased()) == experts, 60, "not re-leased")
            moved_after = time.monotonic() - killed_at
            st = wait_finished(cluster, job_id, timeout=1200)  # about 10 epochs: minutes under load
        finally:
            stop.set()
        assert st["status"] == "succeeded", (st["status_message"], cluster.service("trainer").tail())
        assert st["final_accuracy"] >= spec.stop.target_accuracy
        view = {e["uid"]: e for e in http.get(f"/v1/mixtures/{mixture}").json()["experts"]}
        credit = {h["name"]: h for h in http.get("/v1/admin/hosts").json()}
        model = http.get(f"/v1/jobs/{job_id}/model")
        assert model.status_code == 200, model.text
    # The hostile host was refused, charged and quarantined, and earned nothing; its experts moved.
    assert held and sum(view[uid]["refused"] for uid in held) >= 5
    assert all(view[uid]["leases"] >= 2 for uid in held)
    bad = credit["hostile"]
    assert bad["quarantined_until"] is not None and "answers refused by a trainer" in bad["quarantine_reason"]
    assert bad["credit"] == 0 and all(credit[f"host{i}"]["credit"] > 0 for i in range(2))
    # The killed host's experts moved to the living hosts, within the lease and a heartbeat or two.
    assert orphans and all(view[uid]["leases"] >= 2 for uid in orphans)
    logs = "\n".join(service.tail(100_000) for service, _ in hosts[:2])
    assert any(f"expert {uid}: restored from its checkpoint" in logs for uid in orphans), "none restored"
    lease = spec.experts.heartbeat_seconds * spec.experts.lease_heartbeats
    assert moved_after < lease + 10 * spec.experts.heartbeat_seconds, moved_after
    # The trunk was trained by the volunteer and merged: results of several workunits, each merged once.
    assert st["merges"] >= 6 and st["assignments"].get("merged") == st["merges"]
    # The exported model is the whole model: the trunk, and the weights of the experts' last checkpoints
    # when the job ended (a host may upload one more after), each expert's every tensor.
    tensors = decode(model.content)
    checkpointed = {uid for uid, e in view.items() if e["checkpoint_step"] > 0}
    exported = {name.split("/")[1] for name in tensors if name.startswith("expert/")}
    assert exported and exported <= checkpointed
    assert all(sum(name.startswith(f"expert/{uid}/") for name in tensors) == 4 for uid in exported)
    assert {"embed.weight", "head.1.weight"} <= set(tensors)
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
    # How many are served at that instant is the mixture's own figure: on a loaded machine a living host's
    # renewal can come after its lease ended, and its experts are free until it leases them again.
    served = rf"mixture {mixture} '{re.escape(spec.name)}' \(open\): .*?\d+ of {experts} served"
    assert re.search(served, shown.stdout), shown.stdout
    assert all(uid in shown.stdout for uid in view)
