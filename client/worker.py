"""The client's work loop.

Register once; keep `tasks` assignments training and, with prefetch, the next assignment's files
already downloaded and decoded, so a slot that frees starts training at once; heartbeat; upload
while the next assignment trains. On SIGTERM or a spot-interruption notice, give back at once
every assignment that cannot finish before the notice expires. Running assignments are
journaled and checkpointed, so a client killed outright resumes them when it starts again.
What the thread of one assignment does is in client/assignment.py.
"""

import logging
import os
import signal
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from crowdtrain.client.api import BadReply, Refused, SchedulerAPI
from crowdtrain.client.assignment import BEFORE_UPLOAD, DEFAULT_HEARTBEAT_S, AssignmentRunner, Phase, Running
from crowdtrain.client.cachelock import CacheLock
from crowdtrain.client.config import ClientConfig
from crowdtrain.client.identity import Identities
from crowdtrain.client.journal import AssignmentJournal
from crowdtrain.client.optimizer_states import OptimizerStates
from crowdtrain.client.origins import Origins, learned_origins
from crowdtrain.client.preemption import Notice, RunningEstimate, SpotNoticeWatcher, plan_preemption
from crowdtrain.client.preferences import Preferences
from crowdtrain.client.resources import detect_resources
from crowdtrain.client.restraints import Restraints
from crowdtrain.client.status import ClientState, ClientStatus, StatusWriter
from crowdtrain.client.trust import ProjectTrust
from crowdtrain.core.schemas import AssignmentOut, KeyRotation, WorkReply

log = logging.getLogger(__name__)

HEARTBEAT_TICK_S = 1.0  # how often the heartbeat thread looks for assignments whose heartbeat is due
BAD_REPLY_WAIT = 10.0  # seconds before asking again after a work request or its reply was refused


class VolunteerClient(AssignmentRunner):
    """The volunteer client of one scheduler, as `config` says (crowdtrain.client.config)."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self.server_url = config.server_url.rstrip("/")
        self.device, self.checkpoint_seconds = config.device, config.checkpoint_seconds
        self.cache_dir = Path(config.cache_dir)
        self.cache_lock = CacheLock(self.cache_dir)
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.stop = threading.Event()  # hard stop: no more requests to the server
        self.draining = threading.Event()  # no new work; finish or give back what runs
        self.notice: Notice | None = None
        self.prefs = config.preferences or Preferences(tasks=config.tasks, device=config.device)
        self.origins = Origins.for_scheduler(self.server_url, self.prefs.download_origins)  # before registration
        self.api = SchedulerAPI(
            self.server_url,
            self.stop,
            max_download_rate=config.max_download_rate,
            max_upload_rate=config.max_upload_rate,
            origins=self.origins,
            local_address=str(self.prefs.bind_address) if self.prefs.bind_address else None,
        )
        self.identities = Identities(self.cache_dir / "identity.json")
        self.restraints = Restraints(self.prefs, self.cache_dir, self._files_in_use)
        self.shards, self.snapshots = self.restraints.shards, self.restraints.snapshots
        self.status = StatusWriter(self.cache_dir, self._status)
        self.state, self.state_reason = ClientState.waiting, ""
        self.journal = AssignmentJournal(self.cache_dir / "assignments", self.server_url)
        self.resources = detect_resources(config.device, config.frameworks)
        self.running: dict[int, Running] = {}
        self.lock = threading.Lock()
        self.slot_freed = threading.Event()
        self.compute = threading.Semaphore(config.tasks)
        self.started = 0
        self.completed = 0
        self.train_seconds: dict[int, float] = {}  # job id -> running mean of training time
        self.upload_seconds: float | None = None
        self.optimizer_states = OptimizerStates(config.optimizer_state_bytes)  # memory only
        self.trust = ProjectTrust(self.identities, self.server_url, config.project_key)

    # -- identity -------------------------------------------------------------------------------
    def ensure_registered(self) -> None:
        """Reuse the host token kept on disk for this server, or register with the join token.

        Downloads may then come from the scheduler, the volunteer's allowed origins, and the object
        store the scheduler named when this host registered.
        """
        known = self.identities.get(self.server_url)
        if known is None:
            self.api.token = None
            reg = self.api.register(self.config.join_token, self.name, self.resources, self.prefs.account)
            known = self.identities.save(
                self.server_url,
                reg.host_id,
                reg.host_token,
                learned_origins(reg.download_origins, self.origins.scheduler),
                self.trust.key_to_pin(reg.project_public_key),
                self.trust.refused_jobs,
            )
            log.info("registered with %s as host %s", self.server_url, reg.host_id)
        self.trust.load(known)
        self.api.token = known["host_token"]
        learned = frozenset(learned_origins(known.get("download_origins", []), self.origins.scheduler))
        self.api.origins = Origins(self.origins.scheduler, self.origins.others | learned)
        if learned:
            log.info(
                "downloads allowed from %s and %s", self.origins.scheduler, ", ".join(sorted(self.api.origins.others))
            )

    def _accepts(self, a: AssignmentOut, rotations: list[KeyRotation]) -> bool:
        """Whether `a` is the project's signed work (crowdtrain.client.trust); a refused assignment is
        reported to the scheduler as an error, with the reason."""
        reason = self.trust.check(a, rotations)
        if reason is None:
            return True
        try:
            self.api.report_error(a.assignment_id, f"client refused the assignment: {reason}")
        except Exception as exc:
            log.warning("assignment %s: could not report the refusal (%s); it will time out", a.assignment_id, exc)
        return False

    # -- stopping -------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handle(signum, _frame):
            log.info(
                "signal %s: giving back work that cannot finish within %.0fs, then exiting",
                signal.Signals(signum).name,
                self.config.sigterm_grace,
            )
            self.on_notice(Notice(signal.Signals(signum).name, time.time() + self.config.sigterm_grace))

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def on_notice(self, notice: Notice) -> None:
        """A spot-interruption notice or a signal: stop taking work; `run` decides what finishes."""
        if self.notice is None or notice.at < self.notice.at:
            self.notice = notice
        if notice.action not in ("SIGTERM", "SIGINT"):
            log.warning("spot interruption notice: %s in %.0fs", notice.action, notice.at - time.time())
        self.draining.set()
        self.slot_freed.set()
        self.status.changed()

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Work until stopped; CacheInUse, before anything else, if another client holds the cache."""
        self.cache_lock.acquire()
        try:
            return self._run()
        finally:
            self.cache_lock.release()

    def _run(self) -> int:
        self.ensure_registered()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        if self.config.spot_notice_url:
            cfg = self.config
            watcher = SpotNoticeWatcher(cfg.spot_notice_url, cfg.spot_poll_seconds, self.on_notice, self.stop)
            threading.Thread(target=watcher.run, name="spot-notice", daemon=True).start()
        self.restraints.start(self._on_idle_change)
        self.status.start()
        try:
            self._resume_journaled()
            self._request_loop()
            self._drain()
        finally:
            self._shutdown()
        return 0

    def _in_flight(self) -> tuple[int, int]:
        """(assignments not yet done training, all running assignments)."""
        with self.lock:
            return sum(r.phase in BEFORE_UPLOAD for r in self.running.values()), len(self.running)

    def _request_loop(self) -> None:
        while not self.draining.is_set():
            if self._held_back():
                continue
            want = self._wanted()
            if want is None:
                return
            if want <= 0:
                self.slot_freed.wait(1.0)
                self.slot_freed.clear()
                continue
            reply = self._ask_for_work(want)
            if reply is None:
                continue
            started = [a for a in reply.assignments if self._accepts(a, reply.key_rotations)]
            for a in started:
                self._start(a, reply.heartbeat_interval)
            if not started:
                self.slot_freed.clear()
                if not self.draining.is_set():  # a notice that came during the request has set slot_freed
                    self.slot_freed.wait(reply.retry_after)

    def _wanted(self) -> int | None:
        """How many assignments to ask for now (<= 0: none, the slots are busy), or None once
        `max_assignments` have been started and have all ended."""
        pending, running = self._in_flight()
        want = self.config.tasks + (1 if self.config.prefetch else 0) - pending
        limit = self.config.max_assignments
        if limit is None:
            return want
        if self.started >= limit and running == 0:
            return None
        return min(want, limit - self.started)

    def _ask_for_work(self, want: int) -> WorkReply | None:
        """The scheduler's reply to a request for `want` assignments, or None to ask again: the host
        token was refused (registered again), the request was refused (said, and waited out: a client
        left running outlives a refusal that may pass), we are stopping, or the reply was unusable."""
        try:
            return self.api.request_work(
                want, self.shards.holds(), self.resources, self.trust.refused_jobs, give_up=self.draining
            )
        except Refused as exc:
            if exc.status == 401:
                log.warning("host token refused (%s); registering again", exc.message)
                self.identities.forget(self.server_url)
                self.ensure_registered()
            else:
                log.warning(
                    "the scheduler refused the work request (HTTP %d: %s); asking again in %.0fs",
                    exc.status,
                    exc.message,
                    BAD_REPLY_WAIT,
                )
                self.draining.wait(BAD_REPLY_WAIT)
        except httpx.HTTPError:
            pass  # retries ended because we are stopping
        except BadReply as exc:
            self._refuse_reply(exc)
        return None

    def _refuse_reply(self, exc: BadReply) -> None:
        """A work reply that cannot be used: hand its assignments back as errors, wait, ask again."""
        log.warning("work reply refused: %s; asking again in %.0fs", exc, BAD_REPLY_WAIT)
        for aid in exc.assignment_ids:
            try:
                self.api.report_error(aid, f"client refused the assignment: {exc}")
            except Exception as report_exc:
                log.warning("assignment %s: could not report the refusal (%s); it will time out", aid, report_exc)
        self.draining.wait(BAD_REPLY_WAIT)

    def _resume_journaled(self) -> None:
        """Take up the assignments an earlier run of this client left behind, if still wanted."""
        now = datetime.now(UTC)
        for entry in self.journal.pending():
            a = entry.assignment
            deadline = a.deadline if a.deadline.tzinfo else a.deadline.replace(tzinfo=UTC)
            keep, reason = deadline > now, "its deadline has passed"
            if keep:
                try:
                    reply = self.api.heartbeat(a.assignment_id)
                    keep, reason = reply.keep_going, reply.reason
                except Refused as exc:
                    keep, reason = False, exc.message
                except BadReply as exc:
                    keep, reason = False, str(exc)
            if not keep:
                log.info("assignment %s: left by an earlier run, not resumed (%s)", a.assignment_id, reason)
                self.journal.forget(a.assignment_id)
                continue
            log.info("assignment %s: left by an earlier run; resuming", a.assignment_id)
            # At the interval its work reply named: the scheduler's, or a third of a short lease.
            self._start(a, entry.heartbeat_every or DEFAULT_HEARTBEAT_S)

    def _drain(self) -> None:
        """Finish what fits before the notice expires and give back the rest at once."""
        notice = self.notice
        with self.lock:
            running = list(self.running.values())
        if notice is None:  # max_assignments reached: let everything finish
            for r in running:
                r.join()
            return
        now, mono = time.time(), time.monotonic()
        estimates = []
        for r in running:
            mean = self.train_seconds.get(r.assignment.job_id)
            remaining = (
                None
                if r.phase != Phase.training or mean is None or r.training_since is None
                else max(0.0, mean - (mono - r.training_since))
            )
            if r.phase == Phase.uploading:
                remaining = 0.0
            estimates.append(RunningEstimate(r.assignment.assignment_id, remaining))
        finish, abandon = plan_preemption(estimates, notice.at, now, self.upload_seconds or 1.0)
        for r in running:
            if r.assignment.assignment_id in abandon:
                self._give_back(r)
        for r in running:
            if r.assignment.assignment_id in finish:
                log.info("assignment %s: finishing before the notice expires", r.assignment.assignment_id)
                r.join(max(0.0, notice.at - time.time()))

    def _start(self, a: AssignmentOut, heartbeat_every: float = DEFAULT_HEARTBEAT_S) -> None:
        r = Running(a, heartbeat_every=heartbeat_every)
        r.thread = threading.Thread(target=self._work, args=(r,), name=f"assignment-{a.assignment_id}")
        self.journal.record(a, heartbeat_every)
        with self.lock:  # under the lock, so an idleness change cannot slip between the check and the insert
            if not self.restraints.machine_idle:
                r.control.pause()
            self.running[a.assignment_id] = r
        self.started += 1
        r.thread.start()
        self.status.changed()

    def _shutdown(self) -> None:
        self.stop.set()
        self.restraints.close()
        self.status.close()
        self._set_state(ClientState.stopping)
        self.status.write()
        with self.lock:
            running = list(self.running.values())
        for r in running:
            self._give_back(r)
        for r in running:
            r.join(timeout=30)
        self.api.close()

    # -- volunteer preferences ------------------------------------------------------------------
    def _held_back(self) -> bool:
        """True (after a short wait) while the preferences forbid asking for work."""
        wait = self.restraints.reason_to_wait()
        if wait is None:
            if self.state in (ClientState.not_idle, ClientState.over_cap):
                self._set_state(ClientState.waiting)
            return False
        self._set_state(*wait)
        self.draining.wait(1.0)
        return True

    def _on_idle_change(self, idle: bool) -> None:
        """Pause running training while the machine is in use; resume it when it is idle again."""
        with self.lock:
            for r in self.running.values():
                r.control.resume() if idle else r.control.pause()
        self.status.changed()

    def _set_state(self, state: ClientState, reason: str = "") -> None:
        if state != self.state and state in (ClientState.not_idle, ClientState.over_cap):
            log.info("%s: %s", state.value, reason)
        if (state, reason) != (self.state, self.state_reason):
            self.state, self.state_reason = state, reason
            self.status.changed()

    def _files_in_use(self) -> set[str]:
        with self.lock:
            return {f.sha256 for r in self.running.values() for f in (r.assignment.shard, r.assignment.snapshot)}

    def _status(self) -> ClientStatus:
        with self.lock:
            running = list(self.running.values())
        state = self.state
        if self.draining.is_set():  # a signal or spot notice: finishing or giving back what runs
            state = ClientState.stopping
        elif state in (ClientState.waiting, ClientState.working):
            state = ClientState.working if running else ClientState.waiting
        return ClientStatus(
            pid=os.getpid(),
            state=state,
            reason=self.state_reason,
            server=self.server_url,
            updated_at=datetime.now(UTC),
            assignments=[r.status() for r in running],
            **self.restraints.figures(),
        )

    def _heartbeat_loop(self) -> None:
        """Each assignment held gets a heartbeat when it is due (Running.heartbeat_is_due): every
        `heartbeat_interval` the work reply that brought it named."""
        while not self.stop.wait(HEARTBEAT_TICK_S):
            with self.lock:
                running = list(self.running.values())
            for r in running:
                if not r.heartbeat_is_due(time.monotonic()):
                    continue
                try:
                    reply = self.api.heartbeat(r.assignment.assignment_id)
                except Exception as exc:
                    log.debug("heartbeat for %s failed: %s", r.assignment.assignment_id, exc)
                    continue
                self._heard(r, reply)
