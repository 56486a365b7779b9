"""The client process against a real cluster: clean exit on SIGTERM, patience while the server is down."""

import os
import secrets
import signal
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from crowdtrain.client.status import WRITE_EVERY, read_status
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv, free_port, wait_for
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host, Workunit
from tests.conftest import EXAMPLE_SPEC

pytestmark = pytest.mark.integration


def submit_slow_job(cluster: Cluster) -> int:
    """Assignments that train for a long time, so a test can act while they run. Their deadline is
    long too: on a loaded machine (a full suite with four workers on two cores) a client's first
    heartbeat came after the example job's 60 s, and the assignment timed out under the test."""
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.training.local_epochs = 500
    spec.scheduling.deadline_seconds = 600
    with cluster.admin() as http:
        return http.post("/v1/jobs", json=spec.model_dump(mode="json")).json()["job_id"]


def host_assignments(db_url: str, host_name: str) -> list[tuple[int, str, int]]:
    with session_factory(db_url).begin() as s:
        rows = s.execute(
            select(Assignment.id, Assignment.status, Assignment.workunit_id).join(Host).where(Host.name == host_name)
        ).all()
    return [tuple(r) for r in rows]


def test_sigterm_abandons_running_assignments_and_exits_cleanly(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url)
    submit_slow_job(cluster)
    client = cluster.start_client("volunteer", tasks=2)
    cache = cluster.var_dir / "clients" / "volunteer"

    def training() -> int:
        status = read_status(cache)
        return 0 if status is None else sum(a.phase == "training" for a in status.assignments)

    # Both slots training (the client's status file says so), not a guess of how long that takes.
    wait_for(lambda: training() >= 2, 90, "the client's two slots never trained at once", client)
    client.proc.send_signal(signal.SIGTERM)
    assert client.proc.wait(30) == 0, client.tail()
    rows = host_assignments(sqlite_url, "volunteer")
    assert {status for _, status, _ in rows} == {AssignmentStatus.abandoned.value}
    with session_factory(sqlite_url).begin() as s:
        for _, _, wu_id in rows:
            wu = s.get_one(Workunit, wu_id)
            assert (wu.status, wu.error_count) == (WorkunitStatus.ready.value, 0), "abandoning is no error"


def test_client_waits_for_an_unreachable_server_and_then_works(make_cluster, sqlite_url: str, tmp_path) -> None:
    port, join_token = free_port(), secrets.token_urlsafe(32)
    client = Service(
        "early-bird",
        crowdtrain_argv(
            "client", "--server", f"http://127.0.0.1:{port}", "--cache", str(tmp_path / "cache"), "--name", "early-bird"
        ),
        dict(os.environ, CROWDTRAIN_CLIENT_JOIN_TOKEN=join_token),
        tmp_path / "early-bird.log",
    ).start()
    try:
        # Retrying, and still alive a while later (the first attempt waits for the client's imports).
        wait_for(lambda: "server unreachable" in client.tail(), 60, "the client should be retrying", client)
        # Retried again after its first wait, and still alive: it does not give up after a few tries.
        wait_for(lambda: "retry 3 in" in client.tail(), 60, "the client stopped retrying", client)
        assert client.alive, client.tail()
        cluster = make_cluster(sqlite_url, port=port, join_token=join_token)
        submit_slow_job(cluster)
        wait_for(
            lambda: any(
                st == AssignmentStatus.in_progress.value for _, st, _ in host_assignments(sqlite_url, "early-bird")
            ),
            90,
            "the client never got work after the server came up",
            client,
        )
    finally:
        client.stop()


@pytest.mark.parametrize("prefetch, held", [(True, 2), (False, 1)])
def test_prefetch_holds_the_next_assignment_with_its_files_while_training(
    make_cluster, sqlite_url: str, prefetch: bool, held: int
) -> None:
    from crowdtrain.client.cache import FileCache

    cluster = make_cluster(sqlite_url)
    submit_slow_job(cluster)
    client = cluster.start_client("volunteer", 1, "--prefetch" if prefetch else "--no-prefetch")
    cache = FileCache(cluster.var_dir / "clients" / "volunteer" / "shards")

    def shard_shas(rows: list[tuple[int, str, int]]) -> set[str]:
        with session_factory(sqlite_url).begin() as s:
            from crowdtrain.server.ledger.models import Shard

            return {
                s.scalar(select(Shard.sha256).join(Workunit, Workunit.shard_id == Shard.id).where(Workunit.id == wu_id))
                for _, _, wu_id in rows
            }

    def holding_with_shards() -> bool:
        rows = host_assignments(sqlite_url, "volunteer")
        return len(rows) >= held and shard_shas(rows) <= set(cache.holds())

    # Waits on the state, not a time: a loaded machine takes longer to ask for and fetch the second one.
    wait_for(holding_with_shards, 120, f"the client never held {held} assignment(s) with their shards", client)
    if not prefetch:
        # Two more turns of the client's status (one every couple of seconds, however loaded the machine):
        # time enough to ask for a second assignment, which it does not.
        status_dir = cluster.var_dir / "clients" / "volunteer"

        def written_at() -> datetime:
            status = read_status(status_dir)
            return datetime.min.replace(tzinfo=UTC) if status is None else status.updated_at

        seen = written_at() + timedelta(seconds=2 * WRITE_EVERY)
        wait_for(lambda: written_at() > seen, 60, "the client's status is not written any more", client)
    rows = host_assignments(sqlite_url, "volunteer")
    assert len(rows) == held
    assert {status for _, status, _ in rows} == {AssignmentStatus.in_progress.value}
    assert shard_shas(rows) <= set(cache.holds()), "the prefetched assignment's shard is not downloaded yet"
    client.proc.send_signal(signal.SIGTERM)
    assert client.proc.wait(30) == 0, client.tail()
    assert {status for _, status, _ in host_assignments(sqlite_url, "volunteer")} == {AssignmentStatus.abandoned.value}


def test_a_peer_started_before_its_server_waits_for_it_and_registers(make_cluster, sqlite_url: str, tmp_path) -> None:
    """As the client does: a DeDLOC peer retries past its requests' usual few tries until the
    scheduler answers its registration (before, it gave up within about 1.5 s)."""
    port, join_token = free_port(), secrets.token_urlsafe(32)
    peer = Service(
        "early-peer",
        crowdtrain_argv("peer", "--server", f"http://127.0.0.1:{port}", "--job", "1", "--name", "early-peer"),
        dict(os.environ, CROWDTRAIN_CLIENT_JOIN_TOKEN=join_token),
        tmp_path / "early-peer.log",
    ).start()
    try:
        wait_for(lambda: "retry 6 " in peer.tail(), 90, "the peer should keep retrying", peer)
        assert peer.alive, peer.tail()
        make_cluster(sqlite_url, port=port, join_token=join_token)

        def registered() -> bool:
            with session_factory(sqlite_url).begin() as s:
                return s.scalar(select(Host.id).where(Host.name == "early-peer")) is not None

        wait_for(registered, 60, "the peer never registered once the server came up", peer)
    finally:
        peer.stop()
