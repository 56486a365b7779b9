"""The synchronous DeDLOC mode as real processes: the scheduler (uvicorn), a private Redis and peer
processes that all-reduce with torch.distributed (Gloo) over a rendezvous store the scheduler serves."""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.core import dedloc
from crowdtrain.core.tensors import decode, decode_shard
from crowdtrain.core.zoo import build_model, load_numpy_state, state_to_numpy
from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv
from crowdtrain.workgen.datasets import load_dataset

pytestmark = pytest.mark.integration
JOB_TIMEOUT = 300


def dedloc_spec(max_steps: int, target_accuracy: float = 0.99, **fields) -> dict:
    return {
        "name": "dedloc-test",
        "mode": "dedloc",
        "seed": 3,
        "model": {"name": "cnn1d", "options": {"channels": 16, "kernel_size": 5, "layers": 2}},
        "dataset": {"source": "builtin:mnist1d", "subsets": 4},
        "stop": {"target_accuracy": target_accuracy, "max_steps": max_steps},
        "dedloc": {
            "target_batch_size": 96,
            "micro_batch_size": 16,
            "optimizer": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "matchmaking_timeout": 4,
            "averaging_timeout": 20,
            "report_interval": 0.2,
        }
        | fields,
    }


def submit(cluster: Cluster, spec: dict) -> int:
    with cluster.admin() as http:
        resp = http.post("/v1/jobs", json=spec)
        assert resp.status_code == 201, resp.text
        return resp.json()["job_id"]


def start_peer(cluster: Cluster, job_id: int, name: str, *extra: str) -> Service:
    argv = crowdtrain_argv(
        "peer",
        "--server",
        cluster.url,
        "--job",
        str(job_id),
        "--name",
        name,
        "--threads",
        "1",
        "--trace",
        str(cluster.var_dir / f"{name}.trace"),
        *extra,
    )
    svc = Service(name, argv, cluster.client_env, cluster.var_dir / "logs" / f"{name}.log").start()
    cluster.clients.append(svc)
    return svc


def start_peers(
    cluster: Cluster, job_id: int, count: int, *common: str, only: dict[int, tuple[str, ...]] | None = None
) -> list[Service]:
    """Peers peer-0 .. peer-(count-1), peer i training data rank i of 3, each with the arguments
    `common` and peer i with `only[i]` after them."""
    only = only or {}
    return [
        start_peer(cluster, job_id, f"peer-{i}", "--data-rank", str(i), "--data-world", "3", *common, *only.get(i, ()))
        for i in range(count)
    ]


def wait_finished(cluster: Cluster, job_id: int, peers: list[Service], timeout: float = JOB_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    with cluster.admin() as http:
        while time.monotonic() < deadline:
            st = http.get(f"/v1/jobs/{job_id}").json()
            if st["status"] in ("succeeded", "failed", "cancelled"):
                # The job ends with the first upload of its final state; the other members still
                # apply that step (and write its trace line) before they learn that it has ended.
                for p in peers:
                    if p.alive:
                        p.proc.wait(timeout=120)
                return st
            assert any(p.alive for p in peers), "every peer exited:\n" + "\n".join(p.tail() for p in peers)
            time.sleep(0.5)
    pytest.fail(f"job {job_id} did not finish within {timeout}s: {st}\n" + "\n".join(p.tail(15) for p in peers))


def traces(cluster: Cluster) -> list[dict]:
    return [json.loads(line) for f in sorted(cluster.var_dir.glob("*.trace")) for line in f.read_text().splitlines()]


def stored_state(cluster: Cluster, job_id: int, step: int) -> dict[str, np.ndarray]:
    blob = (
        cluster.var_dir / "storage" / "jobs" / str(job_id) / "dedloc" / f"state-{step:08d}.safetensors"
    ).read_bytes()
    return {k: v for k, v in decode(blob).items() if not k.startswith("__")}


def digests_per_step(cluster: Cluster, job_id: int, steps: range) -> dict[int, dict[str, str]]:
    with cluster.admin() as http:
        return {s: http.get(f"/v1/dedloc/jobs/{job_id}/digests/{s}").json() for s in steps}


def commits(cluster: Cluster, job_id: int) -> dict[int, dict]:
    with cluster.admin() as http:
        return {int(k): v for k, v in http.get(f"/v1/dedloc/jobs/{job_id}/commits").json().items()}


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


def new_process_groups(cluster: Cluster, name: str) -> int:
    """How many process groups the peer process `name` built (a rendezvous each), from its log."""
    return (cluster.var_dir / "logs" / f"{name}.log").read_text().count("new process group for session")


def assert_one_collaboration(cluster: Cluster, job_id: int, steps: range) -> None:
    """Every peer that reported parameters at a step holds the uploaded state of that step."""
    for step, by_peer in digests_per_step(cluster, job_id, steps).items():
        stored = cluster.var_dir / "storage" / "jobs" / str(job_id) / "dedloc" / f"state-{step:08d}.safetensors"
        assert by_peer, f"no peer reported parameters at step {step}"
        assert len(set(by_peer.values())) == 1, f"step {step}: peers differ: {by_peer}"
        if stored.exists():
            assert set(by_peer.values()) == {dedloc.digest(stored_state(cluster, job_id, step))}


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
    assert len(aborted["2:0"]["members"]) == 3 and killed <= set(aborted["2:0"]["members"]), aborted
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


def wait_until(check, timeout: float, message: str, peers: list[Service]) -> None:
    """Poll `check` (a state of the job, not a time) while the peers run."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{message} within {timeout}s\n" + "\n".join(p.tail(15) for p in peers)
        assert all(p.alive for p in peers), "a peer exited:\n" + "\n".join(p.tail() for p in peers)
        time.sleep(0.2)


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


def peer_ids(cluster: Cluster, name: str) -> set[str]:
    """The peer id(s) the process `name` joined as, from its log."""
    log = (cluster.var_dir / "logs" / f"{name}.log").read_text()
    return {line.split("peer ", 1)[1].split(" ", 1)[0] for line in log.splitlines() if "joined job" in line}


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
