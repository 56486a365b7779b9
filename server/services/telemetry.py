"""Operational metrics: event counters and the merge-latency histogram live in Redis, so every
scheduler worker and parameter server adds to the same figures; `/metrics` renders them, with
gauges read from the database, in the Prometheus text format."""

import logging
from datetime import timedelta

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys
from crowdtrain.core.schemas import AssignmentOut
from crowdtrain.core.states import AssignmentStatus, JobStatus
from crowdtrain.server.ledger.models import Assignment, Host, Job, utcnow

log = logging.getLogger(__name__)

EVENTS = {
    "work_requests": "Work requests served",
    "dispatches": "Assignments handed to hosts",
    "uploads": "Results accepted",
    "upload_bytes": "Bytes of the results accepted (weights, or updates as encoded)",
    "merges": "Results merged into W_s",
    "rejections": "Results refused by a parameter server",
    "timeouts": "Assignments timed out by the transitioner",
    "dispatches_cached_shard": "Assignments whose shard the host already had cached",
    "shard_bytes_saved": "Shard bytes hosts did not download because they had the shard cached",
    "shard_bytes_sent": "Shard bytes hosts had to download",
}
MERGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ACTIVE_WINDOW = timedelta(seconds=120)


def count(r: redis.Redis, event: str, n: int = 1, **more: int) -> None:
    """Add to event counters in one round trip; metrics never fail the request they describe."""
    events = {event: n, **more}
    try:
        with r.pipeline(transaction=False) as pipe:
            for name, k in events.items():
                if k > 0:
                    pipe.hincrby(keys.METRIC_COUNTERS, name, k)
            pipe.execute()
    except redis.RedisError as exc:
        log.debug("metrics %s not counted: %s", sorted(events), exc)


def work_request_events(cached_shards: list[str], given: list[AssignmentOut]) -> dict[str, int]:
    """The counters one work request adds: itself, its dispatches, and what the hosts' shard caches saved."""
    cached = set(cached_shards)
    hits = [a.shard.size for a in given if a.shard.sha256 in cached]
    sent = sum(a.shard.size for a in given)
    return {
        "work_requests": 1,
        "dispatches": len(given),
        "dispatches_cached_shard": len(hits),
        "shard_bytes_saved": sum(hits),
        "shard_bytes_sent": sent - sum(hits),
    }


def observe_merge_latency(r: redis.Redis, seconds: float) -> None:
    try:
        with r.pipeline(transaction=False) as pipe:
            for bound in MERGE_BUCKETS:
                if seconds <= bound:
                    pipe.hincrby(keys.MERGE_LATENCY, str(bound), 1)
            pipe.hincrby(keys.MERGE_LATENCY, "+Inf", 1)
            pipe.hincrbyfloat(keys.MERGE_LATENCY, "sum", seconds)
            pipe.execute()
    except redis.RedisError as exc:
        log.debug("merge latency not recorded: %s", exc)


class CrowdtrainCollector(Collector):
    def __init__(self, r: redis.Redis, db: sessionmaker[Session], queue: str):
        self.r, self.db, self.queue = r, db, queue

    def collect(self):
        counters = {keys.text(k): int(v) for k, v in self.r.hgetall(keys.METRIC_COUNTERS).items()}
        for event, help_text in EVENTS.items():
            yield CounterMetricFamily(f"crowdtrain_{event}", help_text, value=counters.get(event, 0))
        hist = {keys.text(k): float(v) for k, v in self.r.hgetall(keys.MERGE_LATENCY).items()}
        buckets = [(str(b), hist.get(str(b), 0.0)) for b in MERGE_BUCKETS] + [("+Inf", hist.get("+Inf", 0.0))]
        yield HistogramMetricFamily(
            "crowdtrain_merge_latency_seconds",
            "Upload received -> W_s updated in Redis",
            buckets=buckets,
            sum_value=hist.get("sum", 0.0),
        )
        yield GaugeMetricFamily(
            "crowdtrain_merge_queue_depth", "Merges waiting for a parameter server", value=self.r.llen(self.queue)
        )
        with self.db.begin() as s:
            active = s.scalar(select(func.count()).select_from(Host).where(Host.last_seen > utcnow() - ACTIVE_WINDOW))
            running = s.scalar(
                select(func.count())
                .select_from(Assignment)
                .where(Assignment.status == AssignmentStatus.in_progress.value)
            )
            jobs = s.scalar(select(func.count()).select_from(Job).where(Job.status == JobStatus.running.value))
        yield GaugeMetricFamily("crowdtrain_active_hosts", "Hosts seen in the last 2 minutes", value=active)
        yield GaugeMetricFamily("crowdtrain_assignments_in_progress", "Assignments being trained", value=running)
        yield GaugeMetricFamily("crowdtrain_jobs_running", "Jobs running", value=jobs)
