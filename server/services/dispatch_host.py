"""The work request's host: its row, authenticated by token or found by id, with the running VC-ASGD
jobs' live columns and how much of each job's work it holds beside it, in one statement (the first of a work request,
crowdtrain.server.services.dispatch); and what the host's request records of it (last seen, declared
resources)."""

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import ColumnElement, Connection, Row, Select, and_, bindparam, select, update

from crowdtrain.core.jobspec import WORKUNIT_MODES
from crowdtrain.core.schemas import Resources
from crowdtrain.core.states import JobStatus
from crowdtrain.server.ledger.models import Host, Job, utcnow
from crowdtrain.server.services.backpressure import in_flight_columns
from crowdtrain.server.services.job_terms import LIVE_JOB_COLUMNS, LiveJob

LAST_SEEN_RESOLUTION = timedelta(seconds=15)

_HOST_COLUMNS = (
    Host.id,
    Host.revoked,
    Host.consecutive_valid,
    Host.frameworks,
    Host.last_seen,
    Host.quarantined_until,
    Host.cpus,
    Host.ram_bytes,
    Host.gpu,
    Host.device,
)
_LIVE_JOB_FIELDS = len(_HOST_COLUMNS)


def host_and_live_jobs(host: ColumnElement[bool]) -> Select:
    """The host's row, once per running VC-ASGD job with that job's live columns and the host's share of
    its work in flight beside it (once with none when no job runs): authentication and what dispatch reads of the jobs,
    in one round trip. Only VC-ASGD jobs have workunits; DeDLOC peers join their job through
    crowdtrain.server.services.dedloc."""
    running = and_(Job.status == JobStatus.running.value, Job.mode.in_(WORKUNIT_MODES))
    return (
        select(*_HOST_COLUMNS, *(c.label(f"job_{c.key}") for c in LIVE_JOB_COLUMNS), *in_flight_columns())
        .select_from(Host)
        .outerjoin(Job, running)
        .where(host)
        .order_by(Job.id)
    )


# Built once: building SQLAlchemy expressions costs more CPU than executing them.
HOST_BY_TOKEN = host_and_live_jobs(Host.token_hash == bindparam("token_hash"))
HOST_BY_ID = host_and_live_jobs(Host.id == bindparam("seen_host"))
HOST_SEEN = update(Host).where(Host.id == bindparam("seen_host")).values(last_seen=bindparam("now"))


def live_jobs(rows: Sequence[Row]) -> dict[int, LiveJob]:
    return {row.job_id: LiveJob(*row[_LIVE_JOB_FIELDS:]) for row in rows if row.job_id is not None}


def note_host(c: Connection, host: Row, resources: Resources | None) -> str:
    """Record that the host asked (at most every LAST_SEEN_RESOLUTION) and what it declared, with one
    statement when anything changed; returns the frameworks it runs."""
    now = utcnow()
    values: dict[str, Any] = {}
    if now - host.last_seen > LAST_SEEN_RESOLUTION:  # spare a row write on most polls
        values["last_seen"] = now
    host_frameworks = host.frameworks
    if resources is not None:
        declared = {
            "cpus": resources.cpus,
            "ram_bytes": resources.ram_bytes,
            "gpu": resources.gpu,
            "device": resources.device,
            "frameworks": ",".join(resources.frameworks),
        }
        values |= {k: v for k, v in declared.items() if getattr(host, k) != v}
        host_frameworks = declared["frameworks"]
    if list(values) == ["last_seen"]:
        c.execute(HOST_SEEN, {"seen_host": host.id, "now": now})
    elif values:
        c.execute(update(Host).where(Host.id == host.id).values(**values))
    return host_frameworks
