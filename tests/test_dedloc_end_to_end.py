"""The synchronous DeDLOC mode as real processes: the scheduler (uvicorn), a private Redis and peer
processes that all-reduce with torch.distributed (Gloo) over a rendezvous store the scheduler serves:
exactness against one process, a peer killed mid-round, a late joiner, and the demo's target. Hostile
peers are tested in tests/test_dedloc_hostile_peers_end_to_end.py."""

from pathlib import Path

import numpy as np
import pytest
import torch

from crowdtrain.core import dedloc
from crowdtrain.core.tensors import decode, decode_shard
from crowdtrain.core.zoo import build_model, load_numpy_state, state_to_numpy
from crowdtrain.launch.cluster import Cluster, crowdtrain_argv
from crowdtrain.workgen.datasets import load_dataset
from tests.dedloc_cluster import (
    assert_one_collaboration,
    commits,
    dedloc_spec,
    digests_per_step,
    new_process_groups,
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


def single_process_reference(cluster: Cluster, job_id: int, spec: dict, batches: list[list[int]]) -> list[dict]:
    """Plain large-batch SGD from the same initial parameters on the same global batches."""
    data = load_dataset(spec["dataset"]["source"])
    # Peers index the job's shards concatenated in index order (the examples as dealt at submission).
    shards = sorted((cluster.var_dir / "storage" / "jobs" / str(job_id) / "shards").glob("*.npz"))
    parts = [decode_shard(p.read_bytes()) for p in shards]
    x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    m = spec["model"]
    model = build_model(m["name"], data.input_shape, data.num_classes, **m["options"])
    load_numpy_state(model, stored_state(cluster, job_id, 0))
    d = spec["dedloc"]
    opt = torch.optim.SGD(model.parameters(), lr=d["lr"], momentum=d["momentum"])
    out = []
    for step, idx in enumerate(batches):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        for g in opt.param_groups:
            g["lr"] = dedloc.learning_rate(step, d["lr"], "constant", 0, spec["stop"]["max_steps"])
        opt.step()
        out.append(state_to_numpy(model))
    return out


def relative_error(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-12)) for k in b)


@pytest.mark.parametrize(
    ("max_group_size", "relayed", "compression", "tolerance"),
    [
        (16, (), "none", 1e-5),  # one Gloo group of 3
        (2, (2,), "none", 1e-5),  # a Gloo group of 2 plus a relayed peer, combined by the scheduler
        (1, (0,), "none", 1e-5),  # three parts: two single-peer groups and a relayed peer
        # float16 on the wire: each gradient within ~2^-11 of float32's, the parameters far closer
        (2, (2,), "float16", 1e-3),
    ],
    ids=["one-group", "group-and-relayed", "three-parts", "float16-group-and-relayed"],
)
def test_three_peers_train_exactly_like_one_process_on_the_same_global_batches(
    make_cluster, max_group_size: int, relayed: tuple[int, ...], compression: str, tolerance: float
) -> None:
    cluster = make_cluster(assimilator_concurrency=1)
    spec = dedloc_spec(max_steps=5, max_group_size=max_group_size, compression=compression)
    job_id = submit(cluster, spec)
    peers = start_peers(cluster, job_id, 3, "--examples-per-step", "32", only={i: ("--relayed",) for i in relayed})
    st = wait_finished(cluster, job_id, peers)
    assert st["status"] == "failed" and "max_steps=5" in st["status_message"], st

    done = commits(cluster, job_id)
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert all(len(c["members"]) == 3 for c in done.values())
    lines = traces(cluster)
    batches = []
    for step in range(5):
        mine = [t for t in lines if t["step"] == step]
        assert len(mine) == 3 and all(t["attempt"] == done[step]["attempt"] for t in mine)
        idx = sorted(i for t in mine for i in t["indices"])
        assert len(idx) == 96 and len(set(idx)) == 96  # disjoint contributions of 32 examples each
        batches.append(idx)

    reference = single_process_reference(cluster, job_id, spec, batches)
    for step in range(1, 6):
        err = relative_error(stored_state(cluster, job_id, step), reference[step - 1])
        assert err <= tolerance, f"step {step}: relative error {err:.3g} against single-process SGD"

    seen = digests_per_step(cluster, job_id, range(1, 6))
    for step, by_peer in seen.items():
        assert len(by_peer) == 3 and len(set(by_peer.values())) == 1, (step, by_peer)
        assert set(by_peer.values()) == {dedloc.digest(stored_state(cluster, job_id, step))}
    if max_group_size == 16 and all(c["attempt"] == 0 for c in done.values()):
        # One group, the same members in every step and no abort: one rendezvous in five steps.
        assert all(new_process_groups(cluster, f"peer-{i}") == 1 for i in range(3))


def test_a_peer_killed_mid_allreduce_is_dropped_and_the_round_retried_without_it(make_cluster) -> None:
    cluster = make_cluster(assimilator_concurrency=1)
    job_id = submit(cluster, dedloc_spec(max_steps=6, target_batch_size=480))
    # The peer to be killed joins first and brings at most a third of a batch a step, so that steps 0
    # to 2 wait for the others whatever its start-up takes under load (it joined after step 2 once).
    doomed = start_peer(
        cluster,
        job_id,
        "peer-2",
        "--data-rank",
        "2",
        "--data-world",
        "3",
        "--kill-at",
        "2:0",
        "--examples-per-step",
        "160",
    )
    wait_until(lambda: bool(peer_ids(cluster, "peer-2")), 120, "peer-2 never joined", [doomed])
    peers = [start_peer(cluster, job_id, f"peer-{i}", "--data-rank", str(i), "--data-world", "3") for i in (0, 1)]
    peers.append(doomed)
    st = wait_finished(cluster, job_id, peers)
    assert st["status"] == "failed" and "max_steps=6" in st["status_message"], st

    assert peers[2].proc.poll() == -9, peers[2].tail()
    done = commits(cluster, job_id)
    assert sorted(done) == list(range(6))
    assert "SIGKILLing itself in the middle of step 2 attempt 0" in peers[2].tail(50)
    with cluster.admin() as http:
        aborted = http.get(f"/v1/dedloc/jobs/{job_id}/aborts").json()
    killed = peer_ids(cluster, "peer-2")
    # The killed peer was a member of the aborted attempt, with peer-0 at least: peer-1 may join after it
    # began, as peer-0 fills the two thirds of a batch the doomed peer leaves, without peer-1.
    assert len(aborted["2:0"]["members"]) >= 2 and killed <= set(aborted["2:0"]["members"]), aborted
    assert not killed & set(done[2]["members"])
    assert done[2]["attempt"] >= 1 and len(done[2]["members"]) == 2, done[2]
    assert all(len(done[s]["members"]) == 2 for s in range(2, 6))
    # A survivor builds a process group only where its group is new: the first step, a step whose
    # members differ from the last commit's, and every retry; the other steps reuse the kept one.
    for name in ("peer-0", "peer-1"):
        me = peer_ids(cluster, name)
        rounds = [(int(k.split(":")[0]), int(k.split(":")[1]), a["members"]) for k, a in aborted.items()]
        rounds += [(s, c["attempt"], c["members"]) for s, c in done.items()]
        # A peer alone in its round reduces nothing and builds no group (a late joiner can leave the
        # first member alone at step 0); otherwise a round builds one unless it keeps the last one.
        made = sum(
            1
            for s, a, members in rounds
            if me & set(members) and len(members) > 1 and (a > 0 or s == 0 or done[s - 1]["members"] != members)
        )
        assert new_process_groups(cluster, name) == made, (name, sorted(rounds))
    # Nobody stepped on the aborted attempt: the survivors applied step 2 once, from the retry.
    applied = [(t["step"], t["attempt"]) for t in traces(cluster) if t["step"] == 2]
    assert applied == [(2, done[2]["attempt"])] * 2, applied
    assert_one_collaboration(cluster, job_id, range(1, 7))


def test_a_peer_that_joins_late_starts_from_the_current_state(make_cluster) -> None:
    """The job's max_steps is out of reach: however slowly the late peer starts, the job is still
    running when it joins. The test waits for the steps it needs, then cancels the job itself."""
    cluster = make_cluster(assimilator_concurrency=1)
    job_id = submit(cluster, dedloc_spec(max_steps=1_000_000, target_batch_size=4800, micro_batch_size=32))
    peers = start_peers(cluster, job_id, 2)
    wait_until(lambda: 2 in commits(cluster, job_id), 240, "step 2 was never committed", peers)
    peers.append(start_peer(cluster, job_id, "peer-late", "--data-rank", "2", "--data-world", "3"))
    late_trace = cluster.var_dir / "peer-late.trace"
    wait_until(
        lambda: late_trace.exists() and len(late_trace.read_text().splitlines()) >= 3,
        360,
        "the late peer did not apply 3 steps",
        peers,
    )
    with cluster.admin() as http:
        assert http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    st = wait_finished(cluster, job_id, peers)
    assert st["status"] == "cancelled", st

    late = [t for t in traces(cluster) if t["peer"] in peer_ids(cluster, "peer-late")]
    first = late[0]
    assert first["step"] >= 3
    # It started from the stored state of the step it joined (parameters and momentum): its digest
    # before its first step is the state's, and after it, everyone's.
    assert first["before"] == dedloc.digest(stored_state(cluster, job_id, first["step"]))
    done = commits(cluster, job_id)
    last = max(done)
    assert last >= first["step"] + 2, done
    assert all(len(done[s]["members"]) == 3 for s in range(first["step"], last + 1)), done
    # The state after the last commit may be cancelled before its members report it.
    assert_one_collaboration(cluster, job_id, range(1, last + 1))


def test_dedloc_reaches_the_vc_asgd_demo_target_on_mnist1d_with_a_relayed_peer(make_cluster) -> None:
    from crowdtrain.core.jobspec import load_job_spec

    spec = load_job_spec(Path(__file__).parents[1] / "examples" / "mnist1d-dedloc.yaml")
    assert spec.stop.target_accuracy == 0.90  # the target of examples/mnist1d-cnn.yaml (VC-ASGD)
    cluster = make_cluster(assimilator_concurrency=1)
    job_id = submit(cluster, spec.model_dump(mode="json"))
    peers = start_peers(cluster, job_id, 3, only={2: ("--relayed",)})
    st = wait_finished(cluster, job_id, peers, timeout=600)
    assert st["status"] == "succeeded", st
    assert st["final_accuracy"] >= 0.90
    steps = st["param_version"]
    with cluster.admin() as http:
        full = http.get(f"/v1/jobs/{job_id}", params={"metrics": True}).json()
        model = http.get(f"/v1/jobs/{job_id}/model")
    assert model.status_code == 200 and dedloc.digest(decode(model.content)) == dedloc.digest(
        stored_state(cluster, job_id, steps)
    )
    assert max(m["val_accuracy"] for m in full["metrics"]) >= 0.90
    relayed = peer_ids(cluster, "peer-2")
    relayed_in = [c for c in commits(cluster, job_id).values() if relayed & set(c["members"])]
    assert relayed_in, "the relayed peer never took part in a step"
    assert_one_collaboration(cluster, job_id, range(1, steps + 1))


def test_the_dedloc_demo_trains_three_peers_one_relayed_to_the_target(tmp_path) -> None:
    import subprocess

    result = subprocess.run(
        crowdtrain_argv("demo", "--mode", "dedloc", "--var-dir", str(tmp_path / "demo")),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout and "3 peers, 1 distinct digest(s)" in result.stdout
    relayed_log = (tmp_path / "demo" / "logs" / "peer-3.log").read_text()
    assert "(relayed)" in relayed_log and "applied step" in relayed_log
