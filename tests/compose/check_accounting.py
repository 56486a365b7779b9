"""Exact accounting of one finished job, checked where the servers run: inside the scheduler container.

    docker-compose ... exec -T scheduler python - JOB_ID < tests/compose/check_accounting.py

Waits until no uploaded result is left unmerged (the clients have been stopped), then checks what
tests/test_training_end_to_end.py's `assert_exact_accounting` checks: no work left open, no workunit
merged twice, every done workunit merged, and Redis's merged set holding exactly the merged assignments,
with W_s's version equal to their number. Prints one summary line; exits 1 naming the first failure.
"""

import sys
import time

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core import keys
from crowdtrain.core.settings import get_settings
from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Job, Workunit

# A lost merge is re-queued by the transitioner within 2 x stuck_upload_seconds (60 s by default).
SETTLE_SECONDS = 150


def fail(message: str) -> None:
    print(f"accounting: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def uploaded_left(db: sessionmaker[Session], job_id: int) -> int:
    with db.begin() as s:
        return (
            s.scalar(
                select(func.count())
                .select_from(Assignment)
                .where(Assignment.job_id == job_id, Assignment.status == AssignmentStatus.uploaded.value)
            )
            or 0
        )


def main(job_id: int) -> None:
    settings = get_settings()
    db = session_factory(settings.database_url)
    deadline = time.monotonic() + SETTLE_SECONDS
    while uploaded_left(db, job_id) and time.monotonic() < deadline:
        time.sleep(1)
    if left := uploaded_left(db, job_id):
        fail(f"{left} uploaded results were never merged or rejected")
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        wus = s.scalars(select(Workunit).where(Workunit.job_id == job_id)).all()
        closed = {WorkunitStatus.done.value, WorkunitStatus.failed.value, WorkunitStatus.cancelled.value}
        if open_wus := [wu.id for wu in wus if wu.status not in closed]:
            fail(f"work left open: workunits {open_wus}")
        merged = s.execute(
            select(Assignment.workunit_id, Assignment.id).where(
                Assignment.job_id == job_id, Assignment.status == AssignmentStatus.merged.value
            )
        ).all()
        merged_wus = [wu_id for wu_id, _ in merged]
        if twice := sorted({wu for wu in merged_wus if merged_wus.count(wu) > 1}):
            fail(f"workunits merged twice: {twice}")
        done = {wu.id for wu in wus if wu.status == WorkunitStatus.done.value}
        if unmerged := sorted(done - set(merged_wus)):
            fail(f"workunits done without a merged assignment: {unmerged}")
        merged_ids = {str(a_id) for _, a_id in merged}
        status = job.status
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    in_redis = set(r.smembers(keys.merged(job_id)))
    if in_redis != merged_ids:
        fail(f"Redis's merged set differs from the database: {sorted(in_redis ^ merged_ids)}")
    version = int(r.get(keys.version(job_id)) or 0)
    if version != len(merged_ids):
        fail(f"W_s version {version} != {len(merged_ids)} merged assignments")
    print(
        f"accounting: job {job_id} {status}: {len(wus)} workunits ({len(done)} done), "
        f"{len(merged_ids)} merged assignments = Redis merged set = W_s version {version}, "
        "no workunit merged twice, no uploaded result left"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))
