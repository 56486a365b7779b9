"""A trainer refuses expert answers it cannot use and counts, per expert and host, what each call came
to (crowdtrain.client.experts.mixture.ExpertClient.take_calls): the figures its reports carry to the
scheduler, which charges refused answers to the host and credits answered rows."""

import threading
from collections.abc import Iterator
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
