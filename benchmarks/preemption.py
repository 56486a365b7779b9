"""How soon a preempted client's workunit runs elsewhere: spot notice -> dispatched again.

What it measures
    A client watching a spot-interruption notice endpoint is training an assignment whose
    deadline (the assignment timeout) is `--timeout` seconds. The endpoint starts serving a
    notice; the client gives the assignment back at once; a second client that has a free slot
    gets the workunit on its next poll. For each of `--trials` runs it records the seconds from
    the moment the client first read the notice (and, for the re-dispatch, from the moment the
    notice appeared, which adds the wait for the client's next poll) to (a) the assignment being abandoned on the
    server and (b) the workunit's next dispatch to the other client. Without the notice the
    workunit would be dispatched again only after the deadline: `--timeout` seconds after it
    was sent, minus however long it had been training. The ratio against the timeout is the
    factor by which prompt abandonment shrinks the `n·p·t_o` preemption term of the run-time
    model `n·t_e + n·p·t_o` (DESIGN.md §4).

How
    A real `Cluster` (private redis-server, scheduler on SQLite, transitioner, one Celery
    parameter server) with clients polling for work every `--retry-after` seconds when none is
    ready. Each trial submits a one-shard mnist1d job with long assignments, starts a watching
    client (polling the notice every `--poll` seconds, IMDSv2 token flow, against a local
    notice server) and a standby client with two slots (one takes the next epoch's workunit,
    the other stays free), waits until the watcher trains, then serves the notice.

Run
    .venv/bin/python benchmarks/preemption.py [--trials 5] [--timeout 120] [--poll 1] [--retry-after 1]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC
from pathlib import Path

from sqlalchemy import select

from crowdtrain.core.jobspec import JobSpec
from crowdtrain.launch.cluster import Cluster, wait_for
from crowdtrain.launch.spot_notice import SpotNoticeServer
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def job_spec(trial: int, timeout: float) -> dict:
    return JobSpec.model_validate(
        {
            "name": f"preemption-{trial}",
            "model": {"name": "cnn1d"},
            "dataset": {"source": "builtin:mnist1d", "subsets": 1},
            "training": {"local_epochs": 1000},
            "stop": {"target_accuracy": 1.0, "max_epochs": 100},
            "scheduling": {"deadline_seconds": timeout},
        }
    ).model_dump(mode="json")


def _host_rows(db, host: str) -> list:
    with db.begin() as s:
        return list(s.scalars(select(Assignment).join(Host).where(Host.name == host).order_by(Assignment.id)))


def _ts(dt) -> float:
    return dt.replace(tzinfo=UTC).timestamp()


def trial(cluster: Cluster, db, n: int, args) -> dict:
    job_id = cluster.submit(job_spec(n, args.timeout))["job_id"]
    notices = SpotNoticeServer()
    spot = cluster.start_client(
        f"spot-{n}", 1, "--no-prefetch", "--spot-notice-url", notices.url, "--spot-poll-seconds", str(args.poll)
    )
    standby = None
    try:
        wait_for(lambda: any(a.status == "in_progress" for a in _host_rows(db, spot.name)), 120, "no work", spot)
        standby = cluster.start_client(f"standby-{n}", 2, "--no-prefetch")
        wait_for(lambda: len(_host_rows(db, standby.name)) == 1, 120, "standby got no work", standby)
        time.sleep(args.train_before)
        (lost,) = _host_rows(db, spot.name)
        announced = time.time()
        notices.announce(seconds_left=120)
        wait_for(lambda: notices.served_at is not None, 30, "notice never read", spot)
        wait_for(
            lambda: any(a.workunit_id == lost.workunit_id for a in _host_rows(db, standby.name)),
            60,
            "workunit not dispatched again",
            standby,
        )
        (lost,) = _host_rows(db, spot.name)
        retry = next(a for a in _host_rows(db, standby.name) if a.workunit_id == lost.workunit_id)
        figures = {
            "abandoned_after_notice": _ts(lost.finished_at) - notices.served_at,
            "redispatched_after_notice": _ts(retry.sent_at) - notices.served_at,
            "redispatched_after_announce": _ts(retry.sent_at) - announced,
            "deadline_after_notice": _ts(lost.deadline) - notices.served_at,
            "status": lost.status,
        }
        say(f"trial {n}: {figures}")
        return figures
    finally:
        with cluster.admin() as http:
            http.post(f"/v1/jobs/{job_id}/cancel")
        spot.stop()
        if standby is not None:
            standby.stop()
        notices.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120.0, help="assignment deadline, seconds")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between the client's notice polls")
    ap.add_argument("--retry-after", type=float, default=1.0, help="seconds an idle client waits between polls")
    ap.add_argument("--train-before", type=float, default=5.0, help="seconds of training before the notice")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ct-preempt-") as tmp:
        cluster = Cluster(
            var_dir=Path(tmp),
            assimilator_concurrency=1,
            extra_env={"CROWDTRAIN_WORK_RETRY_AFTER": str(args.retry_after)},
        )
        cluster.start()
        try:
            db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
            results = [trial(cluster, db, n, args) for n in range(1, args.trials + 1)]
        finally:
            cluster.stop()
    redispatch = [r["redispatched_after_notice"] for r in results]
    waits = [r["deadline_after_notice"] for r in results]
    print(
        json.dumps(
            {
                "benchmark": "preemption",
                "trials": len(results),
                "timeout_seconds": args.timeout,
                "notice_poll_seconds": args.poll,
                "work_retry_after_seconds": args.retry_after,
                "all_abandoned": all(r["status"] == "abandoned" for r in results),
                "abandon_after_notice_p50": round(statistics.median(r["abandoned_after_notice"] for r in results), 3),
                "redispatch_after_notice_p50": round(statistics.median(redispatch), 3),
                "redispatch_after_notice_max": round(max(redispatch), 3),
                # From the notice's first appearance: adds the wait for the client's next poll (<= --poll).
                "redispatch_after_announce_p50": round(
                    statistics.median(r["redispatched_after_announce"] for r in results), 3
                ),
                "redispatch_without_notice_p50": round(statistics.median(waits), 3),
                "ratio_redispatch_to_timeout": round(statistics.median(redispatch) / args.timeout, 4),
                "ratio_redispatch_to_wait_without_notice": round(
                    statistics.median(redispatch) / statistics.median(waits), 4
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
