"""Hostile DeDLOC peers against real processes: a fake peer that claims a billion examples and never
reduces, and a peer that uploads zeroed states. The collaboration neither stalls nor stores them."""

import threading
import time

import numpy as np
import pytest

from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.core import dedloc
from crowdtrain.core.tensors import decode
from crowdtrain.launch.cluster import Cluster
from tests.dedloc_cluster import (
    assert_one_collaboration,
    commits,
    dedloc_spec,
    peer_ids,
    start_peer,
    start_peers,
    stored_state,
    submit,
    traces,
    wait_finished,
    wait_until,
)

pytestmark = pytest.mark.integration


def claim_a_billion(cluster: Cluster, job_id: int, stop: threading.Event) -> str:
    """A scripted fake peer: joins, claims 10^9 examples at every report, never reduces. Returns its id
    once joined (and keeps reporting in a thread until `stop`)."""
    api = PeerAPI(cluster.url)
    api.register(cluster.join_token, "fake")
    joined = api.join(job_id, False)

    def lie() -> None:
        step = joined.step
        while not stop.wait(0.2):
            reply = api.progress(step, 10**9, None, None)
            if reply.action == "stop":
                return
            step = reply.step

    threading.Thread(target=lie, daemon=True).start()
    return joined.peer_id


def test_a_fake_peer_claiming_a_billion_examples_does_not_stall_the_collaboration(make_cluster) -> None:
    cluster = make_cluster(assimilator_concurrency=1)
    job_id = submit(cluster, dedloc_spec(max_steps=6, matchmaking_timeout=2, averaging_timeout=8))
    stop = threading.Event()
    fake = claim_a_billion(cluster, job_id, stop)
    try:
        st = wait_finished(cluster, job_id, start_peers(cluster, job_id, 2))
    finally:
        stop.set()
    assert st["status"] == "failed" and "max_steps=6" in st["status_message"], st
    done = commits(cluster, job_id)
    with cluster.admin() as http:
        aborted = http.get(f"/v1/dedloc/jobs/{job_id}/aborts").json()
    # As many rounds as steps, each a full global batch of the honest peers' examples.
    assert sorted(done) == list(range(6)) and aborted == {}, aborted
    assert all(fake not in c["members"] and sum(c["examples"].values()) >= 96 for c in done.values()), done


def test_a_peer_that_uploads_zeroed_states_is_refused_excluded_and_never_stored(make_cluster) -> None:
    """A hostile peer reports the real parameter digest but uploads its parameters x0, unasked, for every
    state it could: each is refused, it is excluded after `exclude_after` refusals, no stored state is
    zeroed, and a newcomer starts from the collaboration's real parameters. The job's max_steps is out of
    reach: the test waits for step 12 and the newcomer's first step, then cancels the job itself."""
    cluster = make_cluster(assimilator_concurrency=1)
    spec = dedloc_spec(max_steps=1_000_000, target_batch_size=4800, micro_batch_size=32, exclude_after=2)
    job_id = submit(cluster, spec)
    # The poisoner registers first: the lowest host id sorts first, and the first member is each
    # commit's designated uploader. It brings at most 100 examples a step: it cannot close one alone.
    poison = ("--poison-state", "--examples-per-step", "100")
    peers = [start_peer(cluster, job_id, "peer-0", "--data-rank", "0", "--data-world", "3", *poison)]
    deadline = time.monotonic() + 120
    while not peer_ids(cluster, "peer-0"):
        assert time.monotonic() < deadline and peers[0].alive, peers[0].tail()
        time.sleep(0.2)
    peers += [start_peer(cluster, job_id, f"peer-{i}", "--data-rank", str(i), "--data-world", "3") for i in (1, 2)]
    while 3 not in commits(cluster, job_id):
        assert time.monotonic() < deadline + 120, "step 3 was never committed"
        time.sleep(0.2)
    peers.append(start_peer(cluster, job_id, "peer-late", "--data-rank", "2", "--data-world", "3"))
    late_trace = cluster.var_dir / "peer-late.trace"
    # The excluded poisoner may leave: only the honest peers are waited on.
    wait_until(
        lambda: bool(late_trace.exists() and late_trace.read_text().strip() and 12 in commits(cluster, job_id)),
        480,
        "step 12 and the newcomer's first step",
        peers[1:],
    )
    with cluster.admin() as http:
        assert http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    st = wait_finished(cluster, job_id, peers)
    assert st["status"] == "cancelled", st

    poisoner = peer_ids(cluster, "peer-0")
    with cluster.admin() as http:
        refused = http.get(f"/v1/dedloc/jobs/{job_id}/state-refusals").json()
    # Refused at least once; it is out of the collaboration after `exclude_after` refusals, or sooner
    # when it also misses a round as a new peer.
    assert set(refused) == poisoner and all(n >= 1 for n in refused.values()), refused
    done = commits(cluster, job_id)
    assert any(poisoner & set(c["members"]) for c in done.values()), done  # it took part before it was excluded
    # Each step it is a member of costs it a refusal: it is out before the last steps.
    assert all(not poisoner & set(done[s]["members"]) for s in sorted(done)[-2:]), done
    states = sorted((cluster.var_dir / "storage" / "jobs" / str(job_id) / "dedloc").glob("state-*.safetensors"))
    assert len(states) >= 10
    for path in states:
        params = {k: v for k, v in decode(path.read_bytes()).items() if not k.startswith("__")}
        assert any(np.any(v != 0) for v in params.values()), f"{path.name} is zeroed"
    assert_one_collaboration(cluster, job_id, range(1, 13))
    late = [t for t in traces(cluster) if t["peer"] in peer_ids(cluster, "peer-late")]
    assert late, "the newcomer never applied a step"
    start = stored_state(cluster, job_id, late[0]["step"])
    assert late[0]["before"] == dedloc.digest(start) and any(np.any(v != 0) for v in start.values())
