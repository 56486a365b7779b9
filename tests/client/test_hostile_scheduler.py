"""The real client's work loop against a fake, hostile scheduler: a small HTTP server in this process
that registers the client and hands it one crafted work reply. The client must refuse what it is
sent (report the error for the assignment), touch nothing outside its cache, contact no origin but
the scheduler's, and go on asking for work.
"""

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import crowdtrain.client.server_http
import crowdtrain.client.worker
from crowdtrain.client.assignment import Phase, Running
from crowdtrain.client.config import ClientConfig
from crowdtrain.client.preemption import Notice
from crowdtrain.client.worker import VolunteerClient
from crowdtrain.core.schemas import MIN_HEARTBEAT_S, AssignmentOut, HeartbeatReply
from crowdtrain.core.tensors import sha256

AID = 41
SNAPSHOT = b"not really a snapshot"


class RecordingServer:
    """An HTTP server on 127.0.0.1 that records every request and answers with `respond`."""

    def __init__(self, respond: Callable[[str, str, bytes], tuple[int, bytes]]):
        self.requests: list[tuple[str, str, bytes]] = []
        self.authorization: list[str | None] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.requests.append((self.command, self.path, body))
                recorder.authorization.append(self.headers.get("Authorization"))
                status, reply = respond(self.command, self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = do_PUT = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeScheduler(RecordingServer):
    """Registers anyone, hands out `work_reply` once and nothing after it, serves `files` by path."""

    def __init__(self, work_reply: bytes, files: dict[str, bytes], download_origins: list[str] = ()):
        self.pending = [work_reply]
        super().__init__(self.route)
        self.files = files
        self.download_origins = list(download_origins)

    def route(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if (method, path) == ("POST", "/v1/hosts"):
            return 201, json.dumps(
                {"host_id": 7, "host_token": "host-token", "download_origins": self.download_origins}
            ).encode()
        if (method, path) == ("POST", "/v1/work"):
            nothing = json.dumps({"assignments": [], "retry_after": 0.1, "heartbeat_interval": 5.0}).encode()
            return 200, self.pending.pop(0) if self.pending else nothing
        if method == "GET" and path in self.files:
            return 200, self.files[path]
        if re.fullmatch(r"/v1/assignments/\d+/(error|abandon)", path):
            return 200, b"{}"
        if path.endswith("/heartbeat"):
            return 200, b'{"keep_going": true}'
        return 404, b'{"detail": "not here"}'

    def calls(self, method: str, pattern: str) -> list[tuple[str, bytes]]:
        return [(p, b) for m, p, b in self.requests if m == method and re.fullmatch(pattern, p)]


def file_ref(url: str, digest: str, size: int = len(SNAPSHOT)) -> dict:
    return {"url": url, "sha256": digest, "size": size}


def work_reply(shard: dict, snapshot: dict | None = None) -> bytes:
    a = {
        "assignment_id": AID,
        "job_id": 1,
        "workunit_id": 3,
        "epoch": 1,
        "shard_index": 0,
        "base_version": 0,
        "deadline": "2099-01-01T00:00:00Z",
        "recipe": {"model": {"name": "mlp"}, "training": {}, "seed": 0},
        "shard": shard,
        "snapshot": snapshot or file_ref("/files/snapshot", sha256(SNAPSHOT)),
    }
    return json.dumps({"assignments": [a], "retry_after": 0.1, "heartbeat_interval": 5.0}).encode()


def tree(root: Path, skip: Path) -> dict[str, float]:
    """Every path under `root` but those under `skip`, with its mtime."""
    return {str(p): p.stat().st_mtime for p in root.rglob("*") if not p.is_relative_to(skip)}


# Each case: the work reply, given (tmp_path, the other origin's URL); the text the client's error
# report must contain (None: the reply names no assignment the client could hand back).
CASES: dict[str, tuple[Callable[[Path, str], bytes], str | None]] = {
    "sha256 climbing out of the cache": (
        lambda tmp, other: work_reply(file_ref("/files/shard", "../victim/file")),
        "sha256",
    ),
    "sha256 that is an absolute path": (
        lambda tmp, other: work_reply(file_ref("/files/shard", str(tmp / "victim" / "file"))),
        "sha256",
    ),
    "snapshot sha256 naming new directories": (
        lambda tmp, other: work_reply(
            file_ref("/files/snapshot", sha256(SNAPSHOT)), file_ref("/files/snapshot", "../created/dir/x")
        ),
        "sha256",
    ),
    "URL on another origin": (
        lambda tmp, other: work_reply(file_ref(f"{other}/internal", sha256(b"secret"))),
        "refusing to download",
    ),
    "download longer than announced": (
        lambda tmp, other: work_reply(file_ref("/files/snapshot", sha256(SNAPSHOT), size=5)),
        "larger than",
    ),
    "upload encoding the client does not know": (
        lambda tmp, other: work_reply(file_ref("/files/shard", "0" * 64)).replace(
            b'"seed": 0}', b'"seed": 0, "upload": {"send": "delta", "dtype": "int4", "block_size": 1}}'
        ),
        "recipe.upload",
    ),
    "reply larger than the client reads": (
        lambda tmp, other: work_reply(
            file_ref("/files/shard", "0" * 64), file_ref("/files/snapshot", "0" * 64)
        ).replace(b'"mlp"', b'"' + b"x" * 9000 + b'"'),
        None,
    ),
}


def run_client_until(scheduler: FakeScheduler, cache: Path, work_requests: int) -> None:
    """Run the real work loop in this process until it has asked for work `work_requests` times, then
    stop it as SIGTERM does; it must still be running at that point and stop cleanly."""
    volunteer = VolunteerClient(
        ClientConfig(
            scheduler.url,
            "join",
            cache_dir=cache,
            name="volunteer",
            prefetch=False,
            checkpoint_seconds=0,
            frameworks=["pytorch"],
        )
    )
    runner = threading.Thread(target=volunteer.run, daemon=True)
    try:
        runner.start()
        deadline = time.monotonic() + 20
        while len(scheduler.calls("POST", "/v1/work")) < work_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(scheduler.calls("POST", "/v1/work")) >= work_requests, "the client stopped asking for work"
        assert runner.is_alive(), "the client stopped"
    finally:
        volunteer.on_notice(Notice("SIGTERM", time.time()))
        runner.join(30)
    assert not runner.is_alive()


@pytest.mark.parametrize("case", list(CASES))
def test_the_client_refuses_a_hostile_work_reply_and_keeps_working(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(crowdtrain.client.worker, "BAD_REPLY_WAIT", 0.2)
    monkeypatch.setattr(crowdtrain.client.server_http, "MAX_REPLY_BYTES", 8192)
    make_reply, expected = CASES[case]
    victim = tmp_path / "victim" / "file"
    victim.parent.mkdir()
    victim.write_bytes(b"the volunteer's own file")
    old = time.time() - 3600
    os.utime(victim, (old, old))
    other = RecordingServer(lambda method, path, body: (200, b"internal data"))
    scheduler = FakeScheduler(make_reply(tmp_path, other.url), {"/files/snapshot": SNAPSHOT})
    cache = tmp_path / "cache"
    before = tree(tmp_path, cache)
    try:
        run_client_until(scheduler, cache, work_requests=3)
    finally:
        other.close()
        scheduler.close()

    errors = [json.loads(body)["message"] for _, body in scheduler.calls("POST", rf"/v1/assignments/{AID}/error")]
    if expected is None:
        assert errors == []
    else:
        assert len(errors) == 1 and expected in errors[0], errors
    assert scheduler.calls("PUT", r".*") == [], "nothing may be uploaded"
    assert other.requests == [], "the client contacted an origin it was not allowed to"
    assert tree(tmp_path, cache) == before, "the client read, touched or created something outside its cache"
    assert victim.stat().st_mtime == old


def test_a_refused_download_reports_no_digest_of_what_it_fetched(tmp_path: Path) -> None:
    """A scheduler that names a local service (here in another spelling of 127.0.0.1) with a made-up
    sha256 learns from the client's error report that the file was refused, never what it hashes to."""
    secret = b"a local service's secret"
    local = RecordingServer(lambda method, path, body: (200, secret))
    port = local.httpd.server_address[1]
    reply = work_reply(file_ref(f"http://2130706433:{port}/secret", "0" * 64, len(secret)))
    scheduler = FakeScheduler(reply, {"/files/snapshot": SNAPSHOT}, download_origins=[f"http://2130706433:{port}"])
    try:
        run_client_until(scheduler, tmp_path / "cache", work_requests=2)
    finally:
        local.close()
        scheduler.close()
    errors = [json.loads(body)["message"] for _, body in scheduler.calls("POST", rf"/v1/assignments/{AID}/error")]
    assert errors and "does not match its sha256" in errors[0], errors
    assert not any(sha256(secret) in e for e in errors), errors
    pinned = json.loads((tmp_path / "cache" / "identity.json").read_text())[scheduler.url]["download_origins"]
    assert pinned == [f"http://127.0.0.1:{port}"]


def test_the_object_store_named_at_registration_is_downloaded_from_without_the_host_token(tmp_path: Path) -> None:
    shard = b"shard bytes from the object store"
    store = RecordingServer(lambda method, path, body: (200, shard))
    reply = work_reply(file_ref(f"{store.url}/bucket/shard?X-Amz-Signature=s", sha256(shard), len(shard)))
    scheduler = FakeScheduler(
        reply, {"/files/snapshot": SNAPSHOT}, download_origins=[store.url, "http://169.254.169.254"]
    )
    try:
        run_client_until(scheduler, tmp_path / "cache", work_requests=2)
    finally:
        store.close()
        scheduler.close()
    assert [path for _, path, _ in store.requests] == ["/bucket/shard?X-Amz-Signature=s"]
    assert store.authorization == [None], "the host token went to the object store"
    pinned = json.loads((tmp_path / "cache" / "identity.json").read_text())[scheduler.url]["download_origins"]
    assert pinned == [store.url]
    errors = [json.loads(body)["message"] for _, body in scheduler.calls("POST", rf"/v1/assignments/{AID}/error")]
    assert not any("refusing to download" in e for e in errors), errors


def test_a_snapshot_the_scheduler_no_longer_serves_is_logged_as_a_refused_download_and_given_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not "server refused the result: no": no result was sent. The log names the download that was
    refused and what happens next, and the assignment goes back to the server at once."""
    reply = work_reply(file_ref("/files/shard", "0" * 64), file_ref("/files/gone", sha256(SNAPSHOT)))
    scheduler = FakeScheduler(reply, {})
    caplog.set_level(logging.INFO, logger="crowdtrain.client")
    try:
        run_client_until(scheduler, tmp_path / "cache", work_requests=3)
    finally:
        scheduler.close()
    messages = [r.getMessage() for r in caplog.records]
    assert not any("refused the result" in m for m in messages), messages
    assert (
        f"assignment {AID}: the server refused the download of {scheduler.url}/files/gone "
        "(HTTP 404: not here); giving the assignment back"
    ) in messages, messages
    assert scheduler.calls("POST", rf"/v1/assignments/{AID}/abandon")
    assert scheduler.calls("PUT", r".*") == []


@pytest.mark.parametrize(("phase", "stopped"), [("training", True), ("uploading", False), ("uploaded", False)])
def test_a_heartbeat_answered_after_the_clients_own_upload_is_no_reason_to_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, phase: str, stopped: bool
) -> None:
    """The server answers "assignment is uploaded" to a heartbeat that crossed the upload: the client
    says nothing about being stopped; while training, the same answer stops it and says so."""
    volunteer = VolunteerClient(
        ClientConfig("http://127.0.0.1:9", "join", cache_dir=tmp_path / "cache", frameworks=["pytorch"])
    )
    a = AssignmentOut.model_validate(json.loads(work_reply(file_ref("/files/shard", "0" * 64)))["assignments"][0])
    r = Running(a, phase=Phase(phase))
    caplog.set_level(logging.DEBUG, logger="crowdtrain.client")

    volunteer._heard(r, HeartbeatReply(keep_going=False, reason="assignment is uploaded"))

    assert r.control.cancelled.is_set() is stopped
    infos = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.INFO]
    if stopped:
        assert infos == [f"assignment {AID}: the server no longer wants it (assignment is uploaded); stopping it"]
    else:
        assert infos == []


class RefusingScheduler(FakeScheduler):
    """Refuses the first `refusals` work requests with `status` (not a token problem), then serves."""

    def __init__(self, status: int, refusals: int):
        super().__init__(json.dumps({"assignments": [], "retry_after": 0.1, "heartbeat_interval": 5.0}).encode(), {})
        self.status, self.refusals = status, refusals

    def route(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if (method, path) == ("POST", "/v1/work") and self.refusals > 0:
            self.refusals -= 1
            return self.status, b'{"detail": "not now"}'
        return super().route(method, path, body)


@pytest.mark.parametrize("status", [403, 409, 422])
def test_a_refused_work_request_is_said_and_asked_again_and_the_client_keeps_running(
    status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client volunteers leave running outlives a scheduler that refuses its work requests for a
    while: it says so, waits, and asks again (it used to end)."""
    monkeypatch.setattr(crowdtrain.client.worker, "BAD_REPLY_WAIT", 0.1)
    caplog.set_level(logging.WARNING, logger="crowdtrain.client")
    scheduler = RefusingScheduler(status, refusals=2)
    try:
        run_client_until(scheduler, tmp_path / "cache", work_requests=4)
    finally:
        scheduler.close()
    said = [rec.getMessage() for rec in caplog.records if "refused the work request" in rec.getMessage()]
    assert said == [f"the scheduler refused the work request (HTTP {status}: not now); asking again in 0s"] * 2


def test_each_assignment_is_heartbeated_at_the_interval_of_the_reply_that_brought_it(tmp_path: Path) -> None:
    """One assignment came with a 2 s interval, another with 30 s, a third with an interval under the
    floor: in 7 s the first gets a heartbeat every 2 s, the second none, the third one a second at most."""
    beats: dict[int, list[float]] = {1: [], 2: [], 3: []}

    class BeatCounting(FakeScheduler):
        def route(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
            if found := re.fullmatch(r"/v1/assignments/(\d+)/heartbeat", path):
                beats[int(found[1])].append(time.monotonic())
            return super().route(method, path, body)

    scheduler = BeatCounting(b"{}", {})
    volunteer = VolunteerClient(
        ClientConfig(scheduler.url, "join", cache_dir=tmp_path / "cache", frameworks=["pytorch"])
    )
    a = AssignmentOut.model_validate(json.loads(work_reply(file_ref("/files/shard", "0" * 64)))["assignments"][0])
    try:
        volunteer.ensure_registered()
        for aid, every in ((1, 2.0), (2, 30.0), (3, 0.01)):
            held = a.model_copy(update={"assignment_id": aid})
            volunteer.running[aid] = Running(held, phase=Phase.training, heartbeat_every=every)
        beating = threading.Thread(target=volunteer._heartbeat_loop, daemon=True)
        began = time.monotonic()
        beating.start()
        while time.monotonic() - began < 7:
            time.sleep(0.1)
        volunteer.stop.set()
        beating.join(10)
    finally:
        scheduler.close()
    gaps = {aid: [b - a for a, b in zip(at, at[1:], strict=False)] for aid, at in beats.items()}
    assert len(beats[1]) >= 2 and all(gap >= 1.9 for gap in gaps[1]), beats
    assert beats[2] == [], beats
    assert len(beats[3]) >= 3 and all(gap >= MIN_HEARTBEAT_S - 0.1 for gap in gaps[3]), beats


def test_a_heartbeat_is_due_at_the_assignments_interval_never_sooner_than_the_floor() -> None:
    a = AssignmentOut.model_validate(json.loads(work_reply(file_ref("/files/shard", "0" * 64)))["assignments"][0])
    every_30, flooding = Running(a, heartbeat_every=30.0), Running(a, heartbeat_every=0.001)
    assert not every_30.heartbeat_is_due(100.0)  # the first look schedules the first heartbeat
    assert not every_30.heartbeat_is_due(129.9)
    assert every_30.heartbeat_is_due(130.0)
    assert not every_30.heartbeat_is_due(159.0) and every_30.heartbeat_is_due(160.0)
    assert not flooding.heartbeat_is_due(100.0)
    assert not flooding.heartbeat_is_due(100.0 + MIN_HEARTBEAT_S / 2)
    assert flooding.heartbeat_is_due(100.0 + MIN_HEARTBEAT_S)
