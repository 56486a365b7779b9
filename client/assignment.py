"""One assignment on the volunteer client, from download to upload.

`AssignmentRunner` is the half of `VolunteerClient` (client/worker.py) that a thread per assignment
runs: download the snapshot and shard (counted against the daily caps), wait for a compute slot,
train (checkpointed, so a restarted client resumes), upload the result, and give the assignment
back at once when it cannot finish. The other half, the work loop, decides what to run and when.
"""

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from crowdtrain.client.api import Refused, SchedulerAPI
from crowdtrain.client.cache import CacheFull, FileCache
from crowdtrain.client.journal import AssignmentJournal, FileCheckpoint
from crowdtrain.client.optimizer_states import OptimizerStates, keeps_optimizer_state, recipe_key
from crowdtrain.client.quota import DailyTransfer, OverDailyCap, Reservation, counted
from crowdtrain.client.restraints import Restraints
from crowdtrain.client.status import AssignmentStatus, StatusWriter
from crowdtrain.client.trainers import Cancelled, TrainControl, train
from crowdtrain.core import frameworks as fw
from crowdtrain.core.schemas import AssignmentOut, FileRef, HeartbeatReply, Resources, ResultMetrics
from crowdtrain.core.tensors import Params, decode, decode_shard
from crowdtrain.core.updates import encode_result

log = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 4
EWMA_WEIGHT = 0.3  # weight of the newest observation in the running means of task times


@dataclass
class Running:
    """One assignment on this client: fetching -> waiting (for a compute slot) -> training -> uploading."""

    assignment: AssignmentOut
    thread: threading.Thread | None = None
    control: TrainControl = field(default_factory=TrainControl)
    phase: str = "fetching"
    training_since: float | None = None
    given_back: bool = False
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def join(self, timeout: float | None = None) -> None:
        """Wait until the assignment's thread ends, or `timeout` seconds pass."""
        if self.thread is None:  # the runner starts the thread as it adds the assignment to those running
            raise RuntimeError(f"assignment {self.assignment.assignment_id} is running without a thread")
        self.thread.join(timeout)

    def status(self) -> AssignmentStatus:
        a = self.assignment
        phase = "downloading" if self.phase == "fetching" else self.phase
        return AssignmentStatus(
            assignment_id=a.assignment_id,
            job_id=a.job_id,
            epoch=a.epoch,
            shard_index=a.shard_index,
            phase=phase + (" (paused)" if self.control.paused else ""),
            started_at=self.started_at,
            deadline=a.deadline,
        )


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
        a = r.assignment
        aid = a.assignment_id
        transfer, reservation = self.restraints.transfer, None
        try:
            reservation = self.restraints.reserve(a)
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
            r.phase = "waiting"
            self.status.changed()
            while not self.compute.acquire(timeout=0.2):
                r.control.between_batches()
            try:
                r.control.between_batches()
                r.phase, r.training_since = "training", time.monotonic()
                self.status.changed()
                checkpoint = FileCheckpoint(self.journal.checkpoint_path(aid, framework), self.checkpoint_seconds)
                if checkpoint.resumed is not None:
                    log.info("assignment %s: resuming from its checkpoint at %s", aid, checkpoint.resumed[1])
                kept = self._take_optimizer_state(a, resumed=checkpoint.resumed is not None)
                try:
                    result = train(
                        framework,
                        a.recipe.model_dump(),
                        params,
                        x,
                        y,
                        self.device,
                        r.control,
                        checkpoint,
                        a.local_fraction,
                        kept,
                    )
                except BaseException:
                    self._keep_optimizer_state(a, kept)  # unchanged: the slot's next workunit continues it
                    raise
                self._keep_optimizer_state(a, result.optimizer_state)
            finally:
                self.compute.release()
                self.slot_freed.set()
            if checkpoint.resumed is None:
                self.train_seconds[a.job_id] = ewma(self.train_seconds.get(a.job_id), result.seconds)
            r.phase = "uploading"
            self.status.changed()
            t0 = time.monotonic()
            blob = encode_result(result.params, params, a.recipe.upload)  # W_c, or Δ from the snapshot
            self.api.upload(
                a, blob, ResultMetrics(train_loss=result.train_loss, examples=result.examples, seconds=result.seconds)
            )
            r.phase = "uploaded"  # a heartbeat answered from now on crossed this upload
            transfer.record("upload", len(blob), reservation)
            self.upload_seconds = ewma(self.upload_seconds, time.monotonic() - t0)
            log.info(
                "assignment %s: uploaded (epoch %d, shard %d, %s, loss %.4f, %.1fs)",
                aid,
                a.epoch,
                a.shard_index,
                framework,
                result.train_loss,
                result.seconds,
            )
            self.completed += 1
            self.journal.forget(aid)
        except Cancelled:
            log.info("assignment %s: stopped before finishing", aid)
            if not r.given_back:  # the server no longer wants it: hand it back at once
                self._give_back(r)
        except (OverDailyCap, CacheFull) as exc:
            log.warning("assignment %s: giving it back: %s", aid, exc)
            self._give_back(r)
        except Refused as exc:
            if r.phase == "uploading":
                log.warning("assignment %s: the server refused the result (HTTP %d: %s)", aid, exc.status, exc.message)
                self.journal.forget(aid)
            else:  # a snapshot or shard the server no longer serves: let another try it now
                log.warning(
                    "assignment %s: the server refused the %s (HTTP %d: %s); giving the assignment back",
                    aid,
                    exc.request or "download",
                    exc.status,
                    exc.message,
                )
                self._give_back(r)
        except Exception as exc:
            if not self.stop.is_set():
                log.exception("assignment %s: failed", aid)
                try:
                    self.api.report_error(aid, f"{type(exc).__name__}: {exc}")
                except Exception:
                    log.warning("assignment %s: could not report the error; it will time out", aid)
                self.journal.forget(aid)
        finally:
            if reservation is not None:
                transfer.release(reservation)
            with self.lock:
                self.running.pop(aid, None)
            self._prune_snapshots()
            self.slot_freed.set()
            self.status.changed()

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
        if r.phase in ("uploading", "uploaded"):
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
