"""The client's work loop: register once, keep T assignments running, heartbeat, upload, abandon on exit."""

import json
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from client.api import Refused, SchedulerAPI
from client.cache import FileCache
from client.trainers import Cancelled, TrainControl, available_frameworks, train
from crowdtrain import frameworks as fw
from crowdtrain.schemas import AssignmentOut, Resources, ResultMetrics
from crowdtrain.tensors import decode, decode_shard, encode

log = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 4


@dataclass
class Running:
    assignment: AssignmentOut
    thread: threading.Thread
    control: TrainControl = field(default_factory=TrainControl)


def detect_resources(device: str, frameworks: list[str] | None = None) -> Resources:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    gpu = ""
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else ""
    return Resources(cpus=os.cpu_count() or 1, ram_bytes=ram, gpu=gpu, device=device,
                     frameworks=frameworks or available_frameworks())


class VolunteerClient:
    def __init__(self, server_url: str, join_token: str, tasks: int = 1, device: str = "cpu",
                 cache_dir: Path = Path("~/.cache/crowdtrain").expanduser(), name: str | None = None,
                 max_assignments: int | None = None, frameworks: list[str] | None = None):
        self.server_url = server_url.rstrip("/")
        self.join_token = join_token
        self.tasks = tasks
        self.device = device
        self.cache_dir = Path(cache_dir)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.max_assignments = max_assignments
        self.stop = threading.Event()
        self.api = SchedulerAPI(self.server_url, self.stop)
        self.shards = FileCache(self.cache_dir / "shards")
        self.snapshots = FileCache(self.cache_dir / "snapshots")
        self.resources = detect_resources(device, frameworks)
        self.running: dict[int, Running] = {}
        self.lock = threading.Lock()
        self.slot_freed = threading.Event()
        self.completed = 0
        self.heartbeat_interval = 5.0

    # -- identity -------------------------------------------------------------------------------
    def _identity_file(self) -> Path:
        return self.cache_dir / "identity.json"

    def ensure_registered(self) -> None:
        """Reuse the host token kept on disk for this server, or register with the join token."""
        path = self._identity_file()
        ids = json.loads(path.read_text()) if path.is_file() else {}
        if self.server_url in ids:
            self.api.token = ids[self.server_url]["host_token"]
            return
        self.api.token = None
        reg = self.api.register(self.join_token, self.name, self.resources)
        ids[self.server_url] = {"host_id": reg.host_id, "host_token": reg.host_token}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ids))
        tmp.chmod(0o600)
        os.replace(tmp, path)
        self.api.token = reg.host_token
        log.info("registered with %s as host %s", self.server_url, reg.host_id)

    def _forget_identity(self) -> None:
        path = self._identity_file()
        ids = json.loads(path.read_text()) if path.is_file() else {}
        ids.pop(self.server_url, None)
        path.write_text(json.dumps(ids))

    # -- main loop ------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handle(signum, _frame):
            log.info("signal %s: abandoning running assignments and exiting", signal.Signals(signum).name)
            self.stop.set()
            self.slot_freed.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def run(self) -> int:
        self.ensure_registered()
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        try:
            while not self.stop.is_set():
                if self.max_assignments is not None and self.completed >= self.max_assignments:
                    break
                with self.lock:
                    free = self.tasks - len(self.running)
                if free <= 0:
                    self.slot_freed.wait(1.0)
                    self.slot_freed.clear()
                    continue
                try:
                    reply = self.api.request_work(free, self.shards.holds(), self.resources)
                except Refused as exc:
                    if exc.status == 401:
                        log.warning("host token refused (%s); registering again", exc.message)
                        self._forget_identity()
                        self.ensure_registered()
                        continue
                    raise
                except httpx.TransportError:
                    continue  # retries ended because we are stopping
                self.heartbeat_interval = reply.heartbeat_interval
                for a in reply.assignments:
                    self._start(a)
                if not reply.assignments:
                    self.stop.wait(reply.retry_after)
        finally:
            self._shutdown()
        return 0

    def _start(self, a: AssignmentOut) -> None:
        r = Running(a, threading.Thread(target=self._work, args=(a,), name=f"assignment-{a.assignment_id}"))
        with self.lock:
            self.running[a.assignment_id] = r
        r.thread.start()

    def _shutdown(self) -> None:
        with self.lock:
            running = list(self.running.values())
        for r in running:
            r.control.cancel()
            self._abandon(r.assignment.assignment_id)
        for r in running:
            r.thread.join(timeout=30)
        self.api.close()

    def _abandon(self, assignment_id: int) -> None:
        try:
            self.api.abandon(assignment_id)
            log.info("assignment %s: abandoned", assignment_id)
        except httpx.HTTPError as exc:
            log.warning("assignment %s: could not abandon (%s); it will time out", assignment_id, exc)

    # -- one assignment -------------------------------------------------------------------------
    def _work(self, a: AssignmentOut) -> None:
        aid = a.assignment_id
        control = self.running[aid].control
        try:
            snap = self.snapshots.fetch(a.snapshot.sha256, lambda p: self.api.download(a.snapshot.url, p))
            shard = self.shards.fetch(a.shard.sha256, lambda p: self.api.download(a.shard.url, p))
            x, y = decode_shard(shard.read_bytes())
            framework = fw.pick(a.recipe.model, self.resources.frameworks)
            if framework is None:  # the scheduler sends only runnable work; say so rather than guess
                raise RuntimeError(f"model {a.recipe.model['name']!r} needs one of "
                                   f"{fw.able_to_run(a.recipe.model)}; this client has {self.resources.frameworks}")
            result = train(framework, a.recipe.model_dump(), decode(snap.read_bytes()), x, y, self.device, control)
            if control.cancelled.is_set():
                raise Cancelled()
            self.api.upload(a, encode(result.params), ResultMetrics(train_loss=result.train_loss,
                                                                    examples=result.examples, seconds=result.seconds))
            log.info("assignment %s: uploaded (epoch %d, shard %d, %s, loss %.4f, %.1fs)", aid, a.epoch,
                     a.shard_index, framework, result.train_loss, result.seconds)
            self.completed += 1
        except Cancelled:
            log.info("assignment %s: stopped before finishing", aid)
            if not self.stop.is_set():  # the server no longer wants it: hand it back at once
                self._abandon(aid)
        except Refused as exc:
            log.warning("assignment %s: server refused the result: %s", aid, exc.message)
        except Exception as exc:
            if not self.stop.is_set():
                log.exception("assignment %s: failed", aid)
                try:
                    self.api.report_error(aid, f"{type(exc).__name__}: {exc}")
                except Exception:
                    log.warning("assignment %s: could not report the error; it will time out", aid)
        finally:
            with self.lock:
                self.running.pop(aid, None)
            self._prune_snapshots()
            self.slot_freed.set()

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

    def _heartbeat_loop(self) -> None:
        while not self.stop.wait(self.heartbeat_interval):
            with self.lock:
                running = list(self.running.values())
            for r in running:
                try:
                    reply = self.api.heartbeat(r.assignment.assignment_id)
                except Exception as exc:
                    log.debug("heartbeat for %s failed: %s", r.assignment.assignment_id, exc)
                    continue
                if not reply.keep_going:
                    log.info("assignment %s: server says stop (%s)", r.assignment.assignment_id, reply.reason)
                    r.control.cancel()
