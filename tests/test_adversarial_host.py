"""One hostile host cannot wreck a job: its huge, sign-flipped and noisy uploads are refused or
harmless, and the honest client still trains the example job to its target.

Real processes (scheduler, transitioner, Celery parameter server, one `crowdtrain client`); the
hostile host speaks HTTP from this test. `benchmarks/hostile_host.py` runs the same job with and
without it to compare the accuracy reached.
"""

import time

import numpy as np
import pytest
from sqlalchemy import select

from crowdtrain.assimilator.rules.update import params_norm
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.tensors import Params
from crowdtrain.launch.cluster import Cluster, wait_for
from crowdtrain.launch.scripted_host import ScriptedHost
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host, Job
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration
ATTACKS = ("1e30", "sign-flipped x100", "noise")
JOB_TIMEOUT = 300


def hostile_update(kind: str, base: Params, rng: np.random.Generator) -> Params:
    """W_c for one attack, from the snapshot the host was given. A plausible update norm is half
    ||W_base|| (honest ones of this job measure 0.3-1.5 x ||W_base||)."""
    direction = {k: rng.standard_normal(v.shape) for k, v in base.items() if v.dtype.kind == "f"}
    scale = 0.5 * params_norm(base) / params_norm(direction)
    out = dict(base)
    for k, d in direction.items():
        if kind == "1e30":
            out[k] = np.full_like(base[k], 1e30)
        elif kind == "sign-flipped x100":  # W_base - 100 * Δ for a Δ of plausible norm
            out[k] = (base[k] - 100 * scale * d).astype(base[k].dtype)
        else:
            out[k] = (base[k] + scale * d).astype(base[k].dtype)
    return out


def _db(cluster: Cluster):
    return session_factory(cluster.database_url or f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")


def _job(cluster: Cluster, job_id: int) -> Job:
    with _db(cluster).begin() as s:
        return s.get_one(Job, job_id)


def attack(cluster: Cluster, job_id: int, rounds: int = 2, seed: int = 0) -> list[tuple[int, str]]:
    """Upload each attack `rounds` times: the first round while the norm bound is warming up, the
    next ones once it follows the median of accepted updates. Returns (assignment id, attack)."""
    mallory = ScriptedHost(cluster.url, cluster.join_token, "mallory")
    rng = np.random.default_rng(seed)
    sent: list[tuple[int, str]] = []
    for r in range(rounds):
        if r:
            wait_for(
                lambda r=r: _job(cluster, job_id).param_version >= 6 * r or _job(cluster, job_id).status != "running",
                JOB_TIMEOUT,
                "the honest client's merges stopped",
            )
        for kind in ATTACKS:
            if _job(cluster, job_id).status != "running":
                return sent
            work = mallory.next_assignment()
            resp = mallory.upload(work, hostile_update(kind, mallory.snapshot(work), rng))
            assert resp.status_code == 202, resp.text  # well-formed: only the merge policy can refuse it
            sent.append((work["assignment_id"], kind))
    return sent


def run_example_job(cluster: Cluster, hostile: bool, seed: int = 0) -> dict:
    """Train the example job with one honest client (and the hostile host); the job's final figures."""
    job_id = cluster.submit(load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))["job_id"]
    cluster.start_client("alice", tasks=2)
    started = time.monotonic()
    sent = attack(cluster, job_id, seed=seed) if hostile else []
    wait_for(lambda: _job(cluster, job_id).status != "running", JOB_TIMEOUT, "the job did not finish")
    job = _job(cluster, job_id)
    return {
        "job_id": job_id,
        "status": job.status,
        "message": job.status_message,
        "final_accuracy": job.final_accuracy,
        "seconds": time.monotonic() - started,
        "attacks": sent,
    }


def test_a_hostile_host_cannot_keep_the_example_job_from_its_target(make_cluster, sqlite_url) -> None:
    cluster = make_cluster(sqlite_url)
    run = run_example_job(cluster, hostile=True)
    assert run["status"] == "succeeded", run["message"]
    assert run["final_accuracy"] >= 0.85
    db = _db(cluster)

    def decided() -> bool:
        with db.begin() as s:
            return all(
                s.get_one(Assignment, aid).status != AssignmentStatus.uploaded.value for aid, _ in run["attacks"]
            )

    wait_for(decided, 60, "hostile uploads were never merged or refused")
    with db.begin() as s:
        outcomes = [(kind, s.get_one(Assignment, aid)) for aid, kind in run["attacks"]]
        mallory = s.scalars(select(Host).where(Host.name == "mallory")).one()
        refused = [(kind, a.message) for kind, a in outcomes if a.status == AssignmentStatus.rejected.value]
        merged = [kind for kind, a in outcomes if a.status == AssignmentStatus.merged.value]
        failed = mallory.results_failed
    print(
        f"\nwith a hostile host: {run['status']} in {run['seconds']:.0f}s, final accuracy "
        f"{run['final_accuracy']:.3f}; refused {[k for k, _ in refused]}, merged {merged}"
    )
    assert len(run["attacks"]) >= len(ATTACKS), run["attacks"]
    for kind, a in outcomes:
        if kind != "noise":  # huge updates are refused, during warm-up and after it
            assert a.status == AssignmentStatus.rejected.value, (kind, a.status)
            # The second round of "1e30" uploads the first's weights again: refused as a replay first; an
            # all-1e30 W_c is also an update of one constant, which carries no training.
            assert any(why in a.message for why in ("update norm", "a replayed result", "no training")), a.message
    assert failed == len(refused), "each refused update counts against the host"


def test_a_lazy_host_in_a_job_without_validation_is_refused_and_counts_nothing(make_cluster, sqlite_url) -> None:
    """W_base uploaded unchanged, claiming 2^31 - 1 examples, in a job with no `validation:`: the merge
    policy refuses it (no training), the host is charged and earns no credit, and the public page
    counts none of its claimed examples."""
    cluster = make_cluster(sqlite_url)
    spec = load_job_spec(EXAMPLE_SPEC)
    assert not spec.validation.enabled
    cluster.submit(spec.model_dump(mode="json"))
    lazy = ScriptedHost(cluster.url, cluster.join_token, "lazy", account="lazy")
    work = lazy.next_assignment()
    resp = lazy.upload(work, lazy.snapshot(work), {"examples": 2**31 - 1, "seconds": 1, "train_loss": 0.1})
    assert resp.status_code == 202, resp.text
    db = _db(cluster)

    def status() -> str:
        with db.begin() as s:
            return s.get_one(Assignment, work["assignment_id"]).status

    # The first merge waits for the parameter server to import torch: 20-30 s on 2 busy cores.
    wait_for(lambda: status() != AssignmentStatus.uploaded.value, 180, "the lazy result was never judged")
    with db.begin() as s:
        a = s.get_one(Assignment, work["assignment_id"])
        host = s.get_one(Host, lazy.host_id)
        assert a.status == AssignmentStatus.rejected.value and "no training" in a.message, (a.status, a.message)
        assert (a.credit, host.credit, host.results_failed) == (None, 0.0, 1)
    with cluster.admin() as http:
        project = http.get("/v1/project").json()
    assert project["examples"] == 0 and project["credit"] == 0, project


def _colluded(base: Params, workunit_id: int, rng: np.random.Generator) -> Params:
    """W_base + d + ε: d drawn from the workunit id (both hosts of the pair draw the same), ε private."""
    shared = np.random.default_rng(workunit_id)
    d = {k: shared.standard_normal(v.shape) for k, v in base.items() if v.dtype.kind == "f"}
    scale = 0.03 * params_norm(base) / params_norm(d)  # small enough to leave the held-out loss within tolerance
    return {
        k: (v + scale * (d[k] + 0.02 * rng.standard_normal(v.shape))).astype(v.dtype) if k in d else v
        for k, v in base.items()
    }


def test_a_colluding_pair_on_two_networks_is_refused_and_earns_no_credit(make_cluster, sqlite_url) -> None:
    """Two hosts of two accounts on two networks hold the two replicas of one workunit and upload one
    shared direction that neither trained: the vote refuses both, charged, and credits nothing."""
    cluster = make_cluster(sqlite_url)
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["validation"] = {"replicate_untrusted": True}
    job_id = cluster.submit(spec)["job_id"]
    pair = [
        ScriptedHost(cluster.url, cluster.join_token, f"colluder-{i}", account=f"mallory-{i}", local_address=address)
        for i, address in enumerate(("127.0.1.1", "127.0.2.1"))
    ]
    work = [host.next_assignment() for host in pair]
    assert work[0]["workunit_id"] == work[1]["workunit_id"], "the second host is given the first one's replica"
    rng = np.random.default_rng(0)
    for host, a in zip(pair, work, strict=True):
        resp = host.upload(a, _colluded(host.snapshot(a), a["workunit_id"], rng))
        assert resp.status_code == 202, resp.text
    db = _db(cluster)

    def statuses() -> list[str]:
        with db.begin() as s:
            return [s.get_one(Assignment, a["assignment_id"]).status for a in work]

    wait_for(lambda: AssignmentStatus.uploaded.value not in statuses(), 90, "the vote was never decided")
    assert statuses() == [AssignmentStatus.rejected.value] * 2
    with db.begin() as s:
        hosts = [s.get_one(Host, host.host_id) for host in pair]
        assert [(h.credit, h.results_valid, h.results_failed) for h in hosts] == [(0.0, 0, 1)] * 2
        assert all("shows no training" in s.get_one(Assignment, a["assignment_id"]).message for a in work)
    assert _job(cluster, job_id).param_version == 0, "nothing merged"
