"""The DeDLOC peer's HTTP layer against a hostile scheduler: a small real HTTP server in this process
that answers with a huge body, a redirect to another origin, or failures before an answer. The
peer reads a bounded reply, follows no redirect, sends nothing to another origin, and retries what
may succeed later."""

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from crowdtrain.client.dedloc.api import BadReply, PeerAPI
from crowdtrain.client.origins import ForbiddenURL
from crowdtrain.client.server_http import MAX_REPLY_BYTES, TooLarge

Answer = tuple[int, dict[str, str], bytes]
PROGRESS = json.dumps({"action": "accumulate", "step": 3, "state_step": 3, "accumulated": 10, "peers": 2}).encode()


class HostileScheduler:
    """Answers each request with the next of `answers` (the last one again once they run out) and
    counts requests and the bytes it managed to send."""

    def __init__(self, answers: list[Answer]):
        self.answers, self.requests, self.sent = answers, 0, 0
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, body = hostile.answers[min(hostile.requests, len(hostile.answers) - 1)]
                hostile.requests += 1
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    for start in range(0, len(body), 1 << 20):
                        self.wfile.write(body[start : start + (1 << 20)])
                        hostile.sent += min(1 << 20, len(body) - start)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_POST

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hostile() -> Iterator[Callable[[list[Answer]], HostileScheduler]]:
    started: list[HostileScheduler] = []

    def start(answers: list[Answer]) -> HostileScheduler:
        started.append(HostileScheduler(answers))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _peer(server: HostileScheduler) -> PeerAPI:
    api = PeerAPI(server.url, timeout=30)
    api.job_id, api.peer_id = 1, "h1-abcd"
    return api


def test_a_huge_reply_is_refused_once_it_passes_the_bound(hostile) -> None:
    """No Content-Length: the peer reads until the bound, then gives up (the old peer read all 96 MiB)."""
    server = hostile([(200, {"Content-Type": "application/json", "Connection": "close"}, b" " * (3 * MAX_REPLY_BYTES))])
    with pytest.raises(TooLarge, match="larger than"):
        _peer(server).progress(3, 10, None, None)
    assert server.requests == 1, "a reply too large is not asked for again"


def test_a_declared_huge_reply_is_refused_unread(hostile) -> None:
    big = str(10 * MAX_REPLY_BYTES)
    server = hostile([(200, {"Content-Type": "application/json", "Content-Length": big}, b"")])
    with pytest.raises(TooLarge, match=big):
        _peer(server).progress(3, 10, None, None)


def test_a_redirect_to_another_origin_is_refused_and_not_followed(hostile) -> None:
    elsewhere = hostile([(200, {"Content-Type": "application/json", "Content-Length": str(len(PROGRESS))}, PROGRESS)])
    location = f"{elsewhere.url}/latest/meta-data/"
    server = hostile([(302, {"Location": location, "Content-Length": "0"}, b"")])
    with pytest.raises(BadReply, match="redirects are not followed"):
        _peer(server).progress(3, 10, None, None)
    assert elsewhere.requests == 0, "the peer contacted the origin the redirect named"


def test_a_url_of_another_origin_is_refused_before_any_request(hostile) -> None:
    server = hostile([(200, {"Content-Length": "2"}, b"{}")])
    api = _peer(server)
    api.use_token("secret-host-token")
    with pytest.raises(ForbiddenURL, match="refusing"):
        api.request("GET", "http://169.254.169.254/latest/meta-data/")
    assert server.requests == 0


def test_server_errors_are_retried_until_an_answer(hostile) -> None:
    ok = (200, {"Content-Type": "application/json", "Content-Length": str(len(PROGRESS))}, PROGRESS)
    server = hostile([(503, {"Content-Length": "0"}, b""), (500, {"Content-Length": "0"}, b""), ok])
    reply = _peer(server).progress(3, 10, None, None)
    assert reply.action == "accumulate" and reply.accumulated == 10 and server.requests == 3


def test_a_scheduler_that_keeps_failing_is_given_up_on_after_a_few_attempts(hostile) -> None:
    server = hostile([(500, {"Content-Length": "0"}, b"")])
    with pytest.raises(Exception, match="500"):
        _peer(server).progress(3, 10, None, None)
    assert server.requests == 5


def test_a_reply_that_does_not_fit_its_schema_is_a_bad_reply(hostile) -> None:
    body = json.dumps({"action": "explode", "step": 3}).encode()
    server = hostile([(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body)])
    with pytest.raises(BadReply, match="ProgressReply refused: action"):
        _peer(server).progress(3, 10, None, None)
