"""Signed work with real processes: the operator's commands make and use the project key, a real
client pinned to it trains the work it signs, refuses (and reports, and takes no more of) a job whose
recipe is unsigned or signed by another key, and follows a key rotation to the new key; a DeDLOC peer
pinned to it does the same with the jobs it is started for."""

import json
import subprocess
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select

from crowdtrain.core import keys, signing
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv, wait_for
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job
from tests.conftest import quick_spec
from tests.dedloc_cluster import dedloc_spec, start_peer

pytestmark = pytest.mark.integration
TASKS = 2


def operator(cluster: Cluster, *args: str) -> dict:
    """A `crowdtrain` command on the operator's machine; its printed JSON."""
    env = cluster.env | {"CROWDTRAIN_SERVER": cluster.url}
    done = subprocess.run(crowdtrain_argv(*args), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"crowdtrain {' '.join(args)}: {done.stdout}{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def small_spec(tmp_path: Path, name: str) -> Path:
    """The demo job cut to one quick epoch, as a file: it succeeds when epoch 1's merges are in."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(quick_spec(name=name)))
    return path


def wait_status(cluster: Cluster, job_id: int, timeout: float = 240) -> str:
    def ended() -> bool:
        with cluster.admin() as http:
            return http.get(f"/v1/jobs/{job_id}").json()["status"] in ("succeeded", "failed", "cancelled")

    wait_for(ended, timeout, f"job {job_id} did not end")
    with cluster.admin() as http:
        return http.get(f"/v1/jobs/{job_id}").json()["status"]


def test_a_pinned_client_trains_signed_work_refuses_the_rest_and_follows_a_rotation(
    make_cluster, tmp_path: Path
) -> None:
    cluster = make_cluster()
    db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
    key_a = operator(cluster, "admin", "keygen", "--out", str(tmp_path / "a"))
    key_b = operator(cluster, "admin", "keygen", "--out", str(tmp_path / "b"))
    assert (tmp_path / "a" / "project.key").stat().st_mode & 0o777 == 0o600
    operator(cluster, "admin", "project-key", "set", key_a["public_key_file"])

    jobs = {}
    for name in ("good", "foreign", "unsigned"):
        created = operator(cluster, "job", "submit", str(small_spec(tmp_path, name)), "--key", key_a["private_key"])
        assert created["status"] == "running", created
        jobs[name] = created["job_id"]
    # A scheduler whose database was tampered with: one recipe now carries another key's signature,
    # one none at all. The client must not take either.
    other = signing.load_private_key((tmp_path / "b" / "project.key").read_bytes())
    with db.begin() as s:
        foreign = s.get_one(Job, jobs["foreign"])
        assert foreign.recipe is not None
        foreign.recipe_public_key, foreign.recipe_signature = (
            key_b["public_key"],
            signing.sign(other, foreign.recipe.encode()),
        )
        unsigned = s.get_one(Job, jobs["unsigned"])
        unsigned.recipe_public_key = unsigned.recipe_signature = None

    client = cluster.start_client("pinned", TASKS, "--project-key", key_a["public_key_file"])
    assert wait_status(cluster, jobs["good"]) == "succeeded", client.tail()

    with cluster.admin() as http:
        for name, reason in (("foreign", "not by the project key"), ("unsigned", "is unsigned")):
            problems = http.get(f"/v1/jobs/{jobs[name]}/problems").json()
            messages = [p["message"] for p in problems["recent"]]
            assert messages and all("client refused the assignment" in m and reason in m for m in messages), messages

    def given(job_id: int) -> list[str]:
        with db.begin() as s:
            return list(s.scalars(select(Assignment.status).where(Assignment.job_id == job_id)))

    refused_counts = {name: len(given(jobs[name])) for name in ("foreign", "unsigned")}
    for name, count in refused_counts.items():
        # One work reply's worth at most (the slots plus one prefetched), each handed back as an error.
        assert 1 <= count <= TASKS + 1, (name, given(jobs[name]))
        assert set(given(jobs[name])) == {AssignmentStatus.client_error.value}

    # Rotation: the operator makes key C, rotates A -> C, and submits a job signed with C. The client,
    # pinned to A, follows the statement A signed, trains the job, and trusts only C from now on.
    key_c = operator(cluster, "admin", "keygen", "--out", str(tmp_path / "c"))
    operator(
        cluster, "admin", "project-key", "rotate", "--old", key_a["private_key"], "--new", key_c["public_key_file"]
    )
    rotated = operator(cluster, "job", "submit", str(small_spec(tmp_path, "rotated")), "--key", key_c["private_key"])
    assert wait_status(cluster, rotated["job_id"]) == "succeeded", client.tail()
    with db.begin() as s:
        merged = s.scalar(
            select(func.count())
            .select_from(Assignment)
            .where(Assignment.job_id == rotated["job_id"], Assignment.status == AssignmentStatus.merged.value)
        )
    assert merged >= 1
    identity = json.loads((cluster.var_dir / "clients" / "pinned" / "identity.json").read_text())
    (registration,) = identity.values()
    assert registration["project_public_key"] == key_c["public_key"]
    assert sorted(registration["refused_jobs"]) == sorted([jobs["foreign"], jobs["unsigned"]])
    # Two more work requests answered (the pinned client is the cluster's only host): the refused jobs
    # still get nothing. Counted, not slept for: a loaded machine may poll less often.
    polled = served_work_requests(cluster)
    wait_for(lambda: served_work_requests(cluster) >= polled + 2, 120, "the client stopped asking for work", client)
    assert {name: len(given(jobs[name])) for name in refused_counts} == refused_counts


def served_work_requests(cluster: Cluster) -> int:
    """Work requests the cluster's scheduler has answered (its telemetry counter)."""
    with redis.Redis.from_url(cluster.redis_url) as r:
        return int(r.hget(keys.METRIC_COUNTERS, "work_requests") or 0)


def test_a_pinned_dedloc_peer_joins_signed_work_and_refuses_the_rest_for_good(make_cluster, tmp_path: Path) -> None:
    """DeDLOC peers check their job's signed recipe with the same rules: a peer pinned to the project key
    joins a job it signed, refuses (and reports, and never joins again) one signed by another key or unsigned."""
    cluster = make_cluster()
    db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
    key_a = operator(cluster, "admin", "keygen", "--out", str(tmp_path / "a"))
    key_b = operator(cluster, "admin", "keygen", "--out", str(tmp_path / "b"))
    operator(cluster, "admin", "project-key", "set", key_a["public_key_file"])
    jobs = {}
    for name in ("good", "foreign", "unsigned"):
        path = tmp_path / f"dedloc-{name}.json"
        path.write_text(json.dumps(dedloc_spec(max_steps=50) | {"name": name}))
        jobs[name] = operator(cluster, "job", "submit", str(path), "--key", key_a["private_key"])["job_id"]
    other = signing.load_private_key((tmp_path / "b" / "project.key").read_bytes())
    with db.begin() as s:
        foreign = s.get_one(Job, jobs["foreign"])
        assert foreign.recipe is not None
        foreign.recipe_public_key = key_b["public_key"]
        foreign.recipe_signature = signing.sign(other, foreign.recipe.encode())
        unsigned = s.get_one(Job, jobs["unsigned"])
        unsigned.recipe_public_key = unsigned.recipe_signature = None

    def peer(job: str, name: str) -> Service:
        cache = cluster.var_dir / "peers" / name
        return start_peer(cluster, jobs[job], name, "--project-key", key_a["public_key_file"], "--cache", str(cache))

    good = peer("good", "good-peer")
    wait_for(lambda: "applied step 0" in good.tail(500), 120, "the pinned peer did not train the job its key signed")
    good.stop()

    for job, reason in (("foreign", "not by the project key"), ("unsigned", "is unsigned")):
        refusing = peer(job, f"{job}-peer")
        assert refusing.proc is not None and refusing.proc.wait(120) == 3, refusing.tail()
        with cluster.admin() as http:
            findings = http.get(f"/v1/jobs/{jobs[job]}/problems").json()["findings"]
        assert any("refused to train this job" in f and reason in f for f in findings), findings
        identity = json.loads((cluster.var_dir / "peers" / f"{job}-peer" / "identity.json").read_text())
        (registration,) = identity.values()
        assert registration["refused_jobs"] == [jobs[job]]
        again = peer(job, f"{job}-peer")  # the same cache: it does not even join
        assert again.proc is not None and again.proc.wait(60) == 3, again.tail()
        assert "was refused before" in again.tail(500)
        with cluster.admin() as http:
            findings = http.get(f"/v1/jobs/{jobs[job]}/problems").json()["findings"]
        assert len([f for f in findings if "refused to train this job" in f]) == 1, findings
