"""Spot-interruption notices: the decision rule, and a real client against a local notice endpoint."""

from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from crowdtrain.client.preemption import RunningEstimate, parse_notice, plan_preemption
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.launch.cluster import Cluster, wait_for
from crowdtrain.launch.spot_notice import SpotNoticeServer
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host
from tests.conftest import EXAMPLE_SPEC


def test_plan_finishes_only_what_fits_before_the_notice_expires() -> None:
    running = [RunningEstimate(1, 10.0), RunningEstimate(2, 100.0), RunningEstimate(3, None), RunningEstimate(4, 0.0)]
    finish, abandon = plan_preemption(running, notice_at=1000.0 + 30, now=1000.0, upload_seconds=5.0, margin=5.0)
    assert finish == {1, 4}
    assert abandon == {2, 3}


def test_plan_with_a_notice_that_expires_now_abandons_everything() -> None:
    finish, abandon = plan_preemption([RunningEstimate(1, 0.0), RunningEstimate(2, 1.0)], 50.0, 50.0, 0.1)
    assert (finish, abandon) == (set(), {1, 2})


def test_parse_notice_reads_the_aws_format() -> None:
    n = parse_notice({"action": "terminate", "time": "2026-11-22T18:00:00Z"})
    assert n.action == "terminate"
    assert n.at == datetime(2026, 11, 22, 18, 0, tzinfo=UTC).timestamp()


def _submit(cluster: Cluster, local_epochs: int, subsets: int, deadline: float) -> int:
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.training.local_epochs = local_epochs
    spec.dataset.subsets = subsets
    spec.scheduling.deadline_seconds = deadline
    return cluster.submit(spec.model_dump(mode="json"))["job_id"]


def _assignments(db, host: str) -> list[Assignment]:
    with db.begin() as s:
        return list(s.scalars(select(Assignment).join(Host).where(Host.name == host).order_by(Assignment.id)))


@pytest.fixture
def notice_server():
    server = SpotNoticeServer()
    yield server
    server.close()


@pytest.mark.integration
def test_spot_notice_gives_back_running_work_at_once_and_it_is_redispatched_long_before_the_deadline(
    make_cluster, sqlite_url: str, notice_server: SpotNoticeServer
) -> None:
    deadline = 600
    cluster = make_cluster(sqlite_url, extra_env={"CROWDTRAIN_WORK_RETRY_AFTER": "0.5"})
    # One shard: each epoch is one long workunit, so the standby is free to take the given-back one.
    _submit(cluster, local_epochs=500, subsets=1, deadline=deadline)
    db = session_factory(sqlite_url)
    spot = cluster.start_client(
        "spot", 1, "--no-prefetch", "--spot-notice-url", notice_server.url, "--spot-poll-seconds", "0.5"
    )
    wait_for(lambda: any(a.status == "in_progress" for a in _assignments(db, "spot")), 90, "spot got no work", spot)
    standby = cluster.start_client("standby", 2, "--no-prefetch")
    wait_for(lambda: len(_assignments(db, "standby")) == 1, 90, "standby got no work", standby)
    lost = _assignments(db, "spot")[0]

    notice_server.announce(seconds_left=120)
    wait_for(lambda: notice_server.served_at is not None, 10, "the client never read the notice", spot)
    assert spot.proc.wait(30) == 0, spot.tail()

    wait_for(
        lambda: any(a.workunit_id == lost.workunit_id for a in _assignments(db, "standby")),
        30,
        "the given-back workunit was not dispatched again",
        standby,
    )
    (given_back,) = _assignments(db, "spot")
    assert given_back.status == AssignmentStatus.abandoned.value
    retry = next(a for a in _assignments(db, "standby") if a.workunit_id == lost.workunit_id)
    redispatch_after_notice = retry.sent_at.replace(tzinfo=UTC).timestamp() - notice_server.served_at
    # Without the notice the workunit would wait for its deadline, 600 s after dispatch.
    assert redispatch_after_notice < 10, redispatch_after_notice
    assert retry.sent_at < lost.deadline


@pytest.mark.integration
def test_spot_notice_lets_an_assignment_that_fits_finish_and_upload(
    make_cluster, sqlite_url: str, notice_server: SpotNoticeServer
) -> None:
    cluster = make_cluster(sqlite_url)
    _submit(cluster, local_epochs=16, subsets=4, deadline=300)
    db = session_factory(sqlite_url)
    spot = cluster.start_client(
        "spot", 1, "--no-prefetch", "--spot-notice-url", notice_server.url, "--spot-poll-seconds", "0.5"
    )

    def training_after_a_finished_one() -> Assignment | None:
        rows = _assignments(db, "spot")
        done = [a for a in rows if a.status in ("uploaded", "merged")]
        now = datetime.now(UTC).replace(tzinfo=None)
        running = [a for a in rows if a.status == "in_progress" and (now - a.sent_at).total_seconds() > 0.5]
        return running[0] if done and running else None

    # The client needs one finished assignment to estimate how long the next one takes.
    wait_for(lambda: training_after_a_finished_one() is not None, 120, "spot never trained twice", spot)
    notice_server.announce(seconds_left=90)
    assert spot.proc.wait(60) == 0, spot.tail()

    rows = _assignments(db, "spot")
    sent_after = [a.id for a in rows if a.sent_at.replace(tzinfo=UTC).timestamp() > notice_server.served_at]
    assert not sent_after, "the client took new work after the notice"
    last = rows[-1]  # the one training when the notice came: it fits in 90 s, so it is finished
    assert last.status in (AssignmentStatus.uploaded.value, AssignmentStatus.merged.value), last.status
    assert last.uploaded_at.replace(tzinfo=UTC).timestamp() > notice_server.served_at
    assert "finishing before the notice expires" in spot.tail(200)
