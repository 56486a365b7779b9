"""A trainer refuses expert answers it cannot use and counts, per expert and host, what each call came
to (crowdtrain.client.experts.mixture.ExpertClient.take_calls): the figures its reports carry to the
scheduler, which charges refused answers to the host and credits answered rows."""

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from crowdtrain.client.experts.mixture import ExpertCallFailed, ExpertClient
from crowdtrain.core.experts import FORWARD_ARGS, ExpertLayout, encode_call, read_call

LAYOUT = ExpertLayout(layers=1, grid=[2, 3], dim=4, hidden=8, k=2, max_rows=16)
ROWS = 5


def answer(uid: str, rows: int) -> tuple[int, bytes]:
    """What the hostile host answers for each expert: one way of being wrong each, one honest."""
    dim = LAYOUT.dim
    return {
        "0.0.0": (200, encode_call(y=np.full((rows, dim), np.nan))),
        "0.0.1": (200, encode_call(y=np.zeros((rows, dim + 1)))),
        "0.0.2": (200, encode_call(y=np.zeros((rows - 1, dim)))),
        "0.1.0": (200, encode_call(y=np.zeros((LAYOUT.max_rows * 20, dim)))),  # beyond the size limit of an answer
        "0.1.1": (503, b'{"detail": "expert failed"}'),
        "0.1.2": (200, encode_call(y=np.ones((rows, dim)))),
    }[uid]


class Hostile(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        rows = read_call(body, FORWARD_ARGS, LAYOUT.dim, LAYOUT.max_rows)["x"].shape[0]
        status, out = answer(self.path.split("/")[3], rows)
        self.send_response(status)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_unusable_answers_are_refused_and_counted_apart_from_failed_calls_and_answered_rows(url) -> None:
    uids = LAYOUT.uids(0)
    client = ExpertClient(LAYOUT, dict.fromkeys(uids, url))
    x = np.zeros((ROWS, LAYOUT.dim), np.float32)
    outcomes = {}
    for uid in uids:
        try:
            client.submit(uid, "forward", x=x).result(timeout=30)
            outcomes[uid] = "answered"
        except ExpertCallFailed as exc:
            outcomes[uid] = str(exc)
    client.close()
    assert outcomes["0.1.2"] == "answered"
    assert "NaN" in outcomes["0.0.0"] and "shape" in outcomes["0.0.1"] and "4 rows answered for 5" in outcomes["0.0.2"]
    assert "more than" in outcomes["0.1.0"] and "503" in outcomes["0.1.1"]
    counts = {c.uid: (c.answered, c.rows, c.failed, c.refused) for c in client.take_calls()}
    assert counts == {
        "0.0.0": (0, 0, 0, 1),
        "0.0.1": (0, 0, 0, 1),
        "0.0.2": (0, 0, 0, 1),
        "0.1.0": (0, 0, 0, 1),
        "0.1.1": (0, 0, 1, 0),
        "0.1.2": (1, ROWS, 0, 0),
    }
    assert client.take_calls() == []  # taken once


def answering(y: Callable[[np.ndarray], np.ndarray]) -> type[BaseHTTPRequestHandler]:
    """A host whose every expert answers forward with `y(x)`."""

    class Answering(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            x = read_call(self.rfile.read(int(self.headers["Content-Length"])), FORWARD_ARGS, LAYOUT.dim, 16)["x"]
            out = encode_call(y=y(x))
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    return Answering


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_replicas_are_called_in_turn_and_a_sample_of_calls_is_compared_between_two() -> None:
    layout = LAYOUT.model_copy(update={"replicas": 2, "compare_every": 2, "compare_tolerance": 0.5})
    with (
        serving(answering(lambda x: x + 1)) as honest,
        serving(answering(lambda x: x + 1.05)) as close,
        serving(answering(lambda x: np.full_like(x, -5.0))) as made_up,
    ):
        client = ExpertClient(layout, {})
        client.set_routes({("0.0.0", 0): honest, ("0.0.0", 1): close, ("0.0.1", 0): honest, ("0.0.1", 1): made_up})
        x = np.zeros((ROWS, layout.dim), np.float32)
        for uid in ("0.0.0", "0.0.1"):
            for _ in range(4):
                client.submit(uid, "forward", x=x).result(timeout=30)
        deadline = time.monotonic() + 30  # the second answer of a compared call may come after the first
        while client.figures["compared_agreed"] + client.figures["compared_disagreed"] < 4:
            assert time.monotonic() < deadline, client.figures
            time.sleep(0.01)
        client.close()
    counts = {(c.uid, c.url): (c.answered, c.compared, c.disagreed) for c in client.take_calls()}
    # Four calls per expert, at its two replicas in turn; every second one also went to the other.
    assert counts == {
        ("0.0.0", honest): (4, 2, 0),
        ("0.0.0", close): (2, 2, 0),
        ("0.0.1", honest): (4, 2, 2),
        ("0.0.1", made_up): (2, 2, 2),
    }
