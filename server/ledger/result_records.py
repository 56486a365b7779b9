"""What the ledger notes in Redis about results' bytes, beside W_s: which stored upload the scheduler
checked (and the digest of its W_c), and which W_c digests the job's results brought (replays).

A note about an upload is keyed by its storage key, not its assignment, so that two racing uploads of
one assignment cannot pair one's bytes with the other's digest.
"""

import redis

from crowdtrain.core import keys
from crowdtrain.server.paramstore import store


def first_with_digest(r: redis.Redis, job_id: int, digest: str, assignment_id: int) -> int:
    """The assignment that first brought a result whose W_c has this digest: `assignment_id`, recorded
    now, unless an earlier one did (asking again for the same assignment changes nothing). Once the
    job's merges are closed nothing is recorded, and `assignment_id` is returned (it merges nothing)."""
    key = keys.result_digests(job_id)

    def queue(pipe: redis.client.Pipeline) -> None:
        pipe.hsetnx(key, digest, assignment_id)
        pipe.hget(key, digest)

    replies = store.while_open(r, job_id, queue)
    return assignment_id if replies is None else int(replies[1] or assignment_id)


CHECKED_UPLOAD_SECONDS = 7 * 24 * 3600  # after that, an upload still unmerged is checked again in full


def note_checked_upload(r: redis.Redis, job_id: int, upload_key: str, digest: str) -> None:
    """Record that the upload stored under `upload_key` was checked and carries W_c with `digest`."""
    r.set(keys.checked_upload(job_id, upload_key), digest, ex=CHECKED_UPLOAD_SECONDS)


def checked_upload_digest(r: redis.Redis, job_id: int, upload_key: str) -> str | None:
    """The digest `note_checked_upload` recorded for the upload, or None (never checked so, or expired)."""
    raw = r.get(keys.checked_upload(job_id, upload_key))
    return None if raw is None else keys.text(raw)


def forget_checked_upload(r: redis.Redis, job_id: int, upload_key: str) -> None:
    r.delete(keys.checked_upload(job_id, upload_key))
