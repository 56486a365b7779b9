"""One assignment on the volunteer client, from download to upload.

`AssignmentRunner` is the half of `VolunteerClient` (client/worker.py) that a thread per assignment
runs: download the snapshot and shard (counted against the daily caps), wait for a compute slot,
train (checkpointed, so a restarted client resumes), upload the result, and give the assignment
back at once when it cannot finish. The other half, the work loop, decides what to run and when.
"""

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

import httpx
import numpy as np

from crowdtrain.client.api import Refused, SchedulerAPI
from crowdtrain.client.cache import CacheFull, FileCache
from crowdtrain.client.journal import AssignmentJournal, FileCheckpoint
from crowdtrain.client.optimizer_states import OptimizerStates, keeps_optimizer_state, recipe_key
from crowdtrain.client.quota import DailyTransfer, OverDailyCap, Reservation, counted
from crowdtrain.client.restraints import Restraints
from crowdtrain.client.status import AssignmentStatus, StatusWriter
from crowdtrain.client.trainers import Cancelled, TrainControl, TrainResult, train
from crowdtrain.core import frameworks as fw
from crowdtrain.core.schemas import MIN_HEARTBEAT_S, AssignmentOut, FileRef, HeartbeatReply, Resources, ResultMetrics
from crowdtrain.core.tensors import Params, decode, decode_shard
from crowdtrain.core.updates import encode_result

log = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 4
# Seconds between an assignment's heartbeats until a work reply names an interval (an assignment taken
# up again from the journal); no reply makes them fewer than crowdtrain.core.schemas.MIN_HEARTBEAT_S.
DEFAULT_HEARTBEAT_S = 5.0
EWMA_WEIGHT = 0.3  # weight of the newest observation in the running means of task times


class Phase(StrEnum):
    """Where an assignment is on this client; PHASE_MOVES says which phase may follow which. An
    assignment that cannot go on leaves from any phase (given back, failed, refused): it is then no
    longer running here, which is not a phase."""

    fetching = "fetching"  # downloading its snapshot and shard (or finding them cached)
    waiting = "waiting"  # for a compute slot
    training = "training"
    uploading = "uploading"
    uploaded = "uploaded"  # the server has the result: a heartbeat answered from now on crossed the upload


PHASE_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.fetching: frozenset({Phase.waiting}),
    Phase.waiting: frozenset({Phase.training}),
    Phase.training: frozenset({Phase.uploading}),
    Phase.uploading: frozenset({Phase.uploaded}),
    Phase.uploaded: frozenset(),
}
# Phases in which the assignment holds, or waits for, a compute slot's work (the work loop's count).
BEFORE_UPLOAD = frozenset({Phase.fetching, Phase.waiting, Phase.training})


class PhaseError(RuntimeError):
    """A move that PHASE_MOVES does not allow: a bug in the client, never a server's doing."""


@dataclass
class Running:
    """One assignment on this client, in its `phase` (Phase)."""

    assignment: AssignmentOut
    thread: threading.Thread | None = None
    control: TrainControl = field(default_factory=TrainControl)
    phase: Phase = Phase.fetching
    training_since: float | None = None
    given_back: bool = False
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    # Seconds between this assignment's heartbeats (the interval named by the work reply that brought it),
    # and when (time.monotonic()) the next one is due (None: not yet scheduled).
    heartbeat_every: float = DEFAULT_HEARTBEAT_S
    heartbeat_due: float | None = None

    def heartbeat_is_due(self, now: float) -> bool:
        """Whether a heartbeat is due at `now` (time.monotonic()); when it is, the next one is due
        `heartbeat_every` seconds later, never sooner than MIN_HEARTBEAT_S (a scheduler cannot make its
        clients flood it). The first call schedules the first one."""
        due = self.heartbeat_due
        if due is not None and now < due:
            return False
        self.heartbeat_due = now + max(MIN_HEARTBEAT_S, self.heartbeat_every)
        return due is not None

    def move(self, to: Phase) -> None:
        """Enter phase `to`; raises PhaseError unless PHASE_MOVES allows it from the phase now."""
        if to not in PHASE_MOVES[self.phase]:
            raise PhaseError(f"assignment {self.assignment.assignment_id}: no move from {self.phase} to {to}")
        self.phase = to

    def join(self, timeout: float | None = None) -> None:
        """Wait until the assignment's thread ends, or `timeout` seconds pass."""
        if self.thread is None:  # the runner starts the thread as it adds the assignment to those running
            raise RuntimeError(f"assignment {self.assignment.assignment_id} is running without a thread")
        self.thread.join(timeout)

    def status(self) -> AssignmentStatus:
        a = self.assignment
        phase = "downloading" if self.phase == Phase.fetching else self.phase.value
        return AssignmentStatus(
            assignment_id=a.assignment_id,
            job_id=a.job_id,
            epoch=a.epoch,
            shard_index=a.shard_index,
            phase=phase + (" (paused)" if self.control.paused else ""),
            started_at=self.started_at,
            deadline=a.deadline,
        )


@dataclass(frozen=True)
class _Inputs:
    """What an assignment trains: the snapshot's parameters, the shard's examples, and the framework."""

    params: Params
    x: np.ndarray
    y: np.ndarray
    framework: str  # a Framework (crowdtrain.core.frameworks.pick's answer)


def ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new


class AssignmentRunner:
    """Runs one assignment on its own thread; mixed into VolunteerClient, which sets up the state below."""

    api: SchedulerAPI
    device: str
    checkpoint_seconds: float
    resources: Resources
    restraints: Restraints
    shards: FileCache
    snapshots: FileCache
    journal: AssignmentJournal
    status: StatusWriter
    stop: threading.Event
    lock: threading.Lock  # guards `running`
    running: dict[int, Running]
    compute: threading.Semaphore  # one permit per task slot
    slot_freed: threading.Event
    completed: int
    train_seconds: dict[int, float]  # job id -> running mean of training time
    upload_seconds: float | None
    optimizer_states: OptimizerStates  # per job, what the slots' optimizers ended with (keep_optimizer_state)

    def _work(self, r: Running) -> None:
        """Run `r` from its downloads to its upload (the thread's body); an assignment that cannot
        finish is given back, or reported failed, so the server dispatches it again at once."""
        aid = r.assignment.assignment_id
        reservation = None
        try:
            reservation = self.restraints.reserve(r.assignment)
            inputs = self._prepare(r, reservation)
            result, resumed = self._train_in_slot(r, inputs)
            self._upload(r, inputs, result, resumed, reservation)
        except Cancelled:
            log.info("assignment %s: stopped before finishing", aid)
            if not r.given_back:  # the server no longer wants it: hand it back at once
                self._give_back(r)
        except (OverDailyCap, CacheFull) as exc:
            log.warning("assignment %s: giving it back: %s", aid, exc)
            self._give_back(r)
        except Refused as exc:
            self._refused(r, exc)
        except Exception as exc:
            self._failed(r, exc)
        finally:
            if reservation is not None:
                self.restraints.transfer.release(reservation)
            with self.lock:
                self.running.pop(aid, None)
            self._prune_snapshots()
            self.slot_freed.set()
            self.status.changed()

    def _prepare(self, r: Running, reservation: Reservation) -> _Inputs:
        """Download (or find cached) the snapshot and the shard of `r`, and pick the framework."""
        a = r.assignment
        transfer = self.restraints.transfer
        snap = self._fetch(self.snapshots, a.snapshot, transfer, reservation)
        shard = self._fetch(self.shards, a.shard, transfer, reservation)
        x, y = decode_shard(shard.read_bytes())
        params = decode(snap.read_bytes())
        framework = fw.pick(a.recipe.model, self.resources.frameworks)
        if framework is None:  # the scheduler sends only runnable work; say so rather than guess
            raise RuntimeError(
                f"model {a.recipe.model['name']!r} needs one of "
                f"{fw.able_to_run(a.recipe.model)}; this client has {self.resources.frameworks}"
            )
        return _Inputs(params, x, y, framework)

    def _train_in_slot(self, r: Running, inputs: _Inputs) -> tuple[TrainResult, bool]:
        """Wait for a compute slot, then train `r` in it (from its checkpoint, if it has one, and
        from the optimizer state the slot kept, if the job keeps it). Returns the result and whether
        it resumed from a checkpoint."""
        a = r.assignment
        r.move(Phase.waiting)
        self.status.changed()
        while not self.compute.acquire(timeout=0.2):
            r.control.between_batches()
        try:
            r.control.between_batches()
            r.move(Phase.training)
            r.training_since = time.monotonic()
            self.status.changed()
            path = self.journal.checkpoint_path(a.assignment_id, inputs.framework)
            checkpoint = FileCheckpoint(path, self.checkpoint_seconds)
            if checkpoint.resumed is not None:
                log.info("assignment %s: resuming from its checkpoint at %s", a.assignment_id, checkpoint.resumed[1])
            elif a.bind_at_start:
                inputs = self._bind_snapshot(r, inputs)
                a = r.assignment
            kept = self._take_optimizer_state(a, resumed=checkpoint.resumed is not None)
            try:
                result = train(
                    inputs.framework,
                    a.recipe.model_dump(),
                    inputs.params,
                    inputs.x,
                    inputs.y,
                    self.device,
                    r.control,
                    checkpoint,
                    a.local_fraction,
                    kept,
                    self.api,
                )
            except BaseException:
                self._keep_optimizer_state(a, kept)  # unchanged: the slot's next workunit continues it
                raise
            self._keep_optimizer_state(a, result.optimizer_state)
        finally:
            self.compute.release()
            self.slot_freed.set()
        return result, checkpoint.resumed is not None

    def _bind_snapshot(self, r: Running, inputs: _Inputs) -> _Inputs:
        """The job binds snapshots when a slot starts the work (scheduling.snapshot_binding): ask which
        one to train from and fetch it when it is not the one dispatched; the journal then holds the
        assignment with its new base, so a resumed checkpoint is encoded against the snapshot it
        started from. When today's download cap cannot take one more snapshot the scheduler is not
        asked, and the assignment trains from the snapshot it has (the one the scheduler recorded)."""
        a = r.assignment
        transfer = self.restraints.transfer
        try:
            extra = transfer.reserve(a.snapshot.size, 0)
        except OverDailyCap as exc:
            log.info("assignment %s: training from its dispatched snapshot: %s", a.assignment_id, exc)
            return inputs
        try:
            bound = self.api.start(a.assignment_id)
            if bound.base_version == a.base_version:
                return inputs
            if bound.snapshot is None:  # the scheduler's answers say it can only be the dispatched one
                raise RuntimeError(f"the scheduler bound snapshot v{bound.base_version} without naming its file")
            snap = self._fetch(self.snapshots, bound.snapshot, transfer, extra)
            params = decode(snap.read_bytes())
            r.assignment = a.model_copy(update={"base_version": bound.base_version, "snapshot": bound.snapshot})
            self.journal.record(r.assignment, r.heartbeat_every)
            log.info(
                "assignment %s: training from snapshot v%d (dispatched with v%d)",
                a.assignment_id,
                bound.base_version,
                a.base_version,
            )
            return replace(inputs, params=params)
        finally:
            transfer.release(extra)

    def _upload(
        self, r: Running, inputs: _Inputs, result: TrainResult, resumed: bool, reservation: Reservation
    ) -> None:
        """Upload `r`'s result (W_c, or Δ from the snapshot, as the recipe says) and forget it here."""
        a = r.assignment
        if not resumed:  # a resumed run's time covers part of the work
            self.train_seconds[a.job_id] = ewma(self.train_seconds.get(a.job_id), result.seconds)
        r.move(Phase.uploading)
        self.status.changed()
        t0 = time.monotonic()
        blob = encode_result(result.params, inputs.params, a.recipe.upload)
        self.api.upload(
            a, blob, ResultMetrics(train_loss=result.train_loss, examples=result.examples, seconds=result.seconds)
        )
        r.move(Phase.uploaded)  # a heartbeat answered from now on crossed this upload
        self.restraints.transfer.record("upload", len(blob), reservation)
        self.upload_seconds = ewma(self.upload_seconds, time.monotonic() - t0)
        log.info(
            "assignment %s: uploaded (epoch %d, shard %d, %s, loss %.4f, %.1fs)",
            a.assignment_id,
            a.epoch,
            a.shard_index,
            inputs.framework,
            result.train_loss,
            result.seconds,
        )
        self.completed += 1
        self.journal.forget(a.assignment_id)

    def _refused(self, r: Running, exc: Refused) -> None:
        """The server refused a request of `r`: its upload (the result is dropped here), or a download
        it no longer serves (the assignment goes back, for another host to try now)."""
        aid = r.assignment.assignment_id
        if r.phase == Phase.uploading:
            log.warning("assignment %s: the server refused the result (HTTP %d: %s)", aid, exc.status, exc.message)
            self.journal.forget(aid)
            return
        log.warning(
            "assignment %s: the server refused the %s (HTTP %d: %s); giving the assignment back",
            aid,
            exc.request or "download",
            exc.status,
            exc.message,
        )
        self._give_back(r)

    def _failed(self, r: Running, exc: Exception) -> None:
        """`r` failed here: report it (it counts toward its workunit's error limit), unless this client
        is stopping, when the journal keeps it for the next start."""
        if self.stop.is_set():
            return
        aid = r.assignment.assignment_id
        log.exception("assignment %s: failed", aid, exc_info=exc)
        try:
            self.api.report_error(aid, f"{type(exc).__name__}: {exc}")
        except Exception:
            log.warning("assignment %s: could not report the error; it will time out", aid)
        self.journal.forget(aid)

    def _take_optimizer_state(self, a: AssignmentOut, resumed: bool) -> Params | None:
        """The optimizer state this slot's training of `a` starts from: with the recipe's
        keep_optimizer_state, the one a previous workunit of the job ended with; a workunit resumed
        from its checkpoint has its own."""
        if resumed or not keeps_optimizer_state(a.recipe):
            return None
        return self.optimizer_states.take(a.job_id, recipe_key(a.recipe))

    def _keep_optimizer_state(self, a: AssignmentOut, state: Params | None) -> None:
        if state is not None and keeps_optimizer_state(a.recipe):
            self.optimizer_states.put(a.job_id, recipe_key(a.recipe), state)

    def _heard(self, r: Running, reply: HeartbeatReply) -> None:
        """Act on the reply to a heartbeat for `r`: stop it when the server no longer wants it. A reply
        that crossed this client's own upload (the assignment is `uploaded`) is no reason to stop."""
        if reply.keep_going:
            return
        aid = r.assignment.assignment_id
        if r.phase in (Phase.uploading, Phase.uploaded):
            log.debug("assignment %s: heartbeat answered after its upload (%s)", aid, reply.reason)
            return
        log.info("assignment %s: the server no longer wants it (%s); stopping it", aid, reply.reason)
        r.control.cancel()

    def _fetch(self, cache: FileCache, ref: FileRef, transfer: DailyTransfer, reservation: Reservation | None) -> Path:
        """The verified local copy of `ref`, downloaded (no more than its declared size) if not cached."""
        download = counted(lambda p: self.api.download(ref.url, p, ref.size), transfer, reservation)
        return cache.fetch(ref.sha256, download, ref.size)

    def _prune_snapshots(self) -> None:
        """Keep the newest few snapshots: each merge publishes a new one, so old ones are never reused."""
        with self.lock:
            in_use = {r.assignment.snapshot.sha256 for r in self.running.values()}
        dated = []
        for p in self.snapshots.root.glob("??/*"):
            try:
                dated.append((p.stat().st_mtime, p))
            except FileNotFoundError:  # pruned by another slot meanwhile
                continue
        for _, p in sorted(dated, reverse=True)[KEEP_SNAPSHOTS:]:
            if p.name not in in_use:
                p.unlink(missing_ok=True)

    def _give_back(self, r: Running) -> None:
        """Cancel the assignment here and tell the server at once, so it is dispatched again."""
        if r.given_back:
            return
        r.given_back = True
        r.control.cancel()
        aid = r.assignment.assignment_id
        try:
            self.api.abandon(aid)
            log.info("assignment %s: abandoned (%s)", aid, r.phase)
        except httpx.HTTPError as exc:
            log.warning("assignment %s: could not abandon (%s); it will time out", aid, exc)
        self.journal.forget(aid)
