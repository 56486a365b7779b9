"""The W_s a parameter-server process keeps between its merges (crowdtrain.server.paramstore.merging.merge_batch).

A process runs one merge at a time. It keeps the W_s and rule state it wrote last, with the random tag
written beside them in Redis (`keys.params_tag`): while Redis still holds that tag, no other process
and no restore wrote W_s since, and the next merge here reads neither back (20 MB for a 5M-parameter
model). Process-local; no I/O.
"""

from collections.abc import Callable
from dataclasses import dataclass

from crowdtrain.core.tensors import Params, encode, views


@dataclass
class CachedModel:
    """W_s and the rule's state as safetensors buffers, with writable numpy views into them.

    A merge updates the views in place, so the buffers are the new blobs: no decode, no encode.
    """

    tag: str | None  # keys.params_tag of this W_s; None (never taken for Redis's) for one written before tags
    version: int
    blob: bytearray
    params: Params
    state_blob: bytearray
    state: Params

    @classmethod
    def of(
        cls,
        tag: str | None,
        version: int,
        blob: bytes,
        state_blob: bytes | None,
        initial_state: Callable[[Params], Params] | None,
    ) -> "CachedModel":
        """Writable copies of W_s and of its state as read from Redis; a state Redis lacks is made from
        `initial_state(W_s)` (empty without one)."""
        params_buffer = bytearray(blob)
        params = views(params_buffer)
        if state_blob is None:
            state_blob = encode(initial_state(params) if initial_state is not None else {})
        state_buffer = bytearray(state_blob)
        return cls(tag, version, params_buffer, params, state_buffer, views(state_buffer))


# Jobs whose W_s a process holds at once, the most recently merged: a parameter server serves jobs
# one after another for as long as it runs, and those that ended would otherwise stay in its memory.
JOBS_HELD = 4

_held: dict[int, CachedModel] = {}  # in the order they were last kept


def take(job_id: int, tag: str | None) -> CachedModel | None:
    """The job's W_s held here when it is the one Redis tags `tag`, taken out, so that a merge that
    fails midway cannot leave a changed copy behind; None otherwise."""
    model = _held.pop(job_id, None)
    return model if model is not None and model.tag is not None and model.tag == tag else None


def keep(job_id: int, model: CachedModel) -> None:
    """Hold `model`, the W_s this process has just written, for the job's next merge; the least
    recently merged job's beyond JOBS_HELD is let go."""
    _held.pop(job_id, None)
    _held[job_id] = model
    while len(_held) > JOBS_HELD:
        del _held[next(iter(_held))]


def clear() -> None:
    _held.clear()
