"""A moe job with a hostile expert host: it leases experts like any host but answers their calls with
NaN. The volunteer training the trunk refuses those answers (the rows go on with the other experts),
reports them, and the scheduler charges the host until it is quarantined; its experts move to the
honest host, and the job still reaches its target. (Answers of the wrong shape, too large or of the
wrong rows are refused alike: tests/client/experts/test_answers.py.)"""

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from crowdtrain.client.experts.leasing import MixtureAPI
from crowdtrain.client.server_http import Refused
from crowdtrain.core.experts import FORWARD_ARGS, encode_call, read_call
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import wait_for
from tests.conftest import ROOT
from tests.test_training_end_to_end import job_status, wait_finished

pytestmark = pytest.mark.integration

SPEC = ROOT / "examples" / "clusters-moe.yaml"


def hostile_handler(dim: int) -> type[BaseHTTPRequestHandler]:
    class Hostile(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # the scheduler's connect-back probe
            self._send(200, b'{"status": "ok"}')

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            rows = read_call(body, FORWARD_ARGS, dim, 1 << 16)["x"].shape[0]
            self._send(200, encode_call(y=np.full((rows, dim), np.nan)))

    return Hostile


@pytest.fixture
def hostile() -> Iterator[str]:
    """A hostile expert host's URL (serving nothing until it leases)."""
    layout = load_job_spec(SPEC).experts
    assert layout is not None
    server = ThreadingHTTPServer(("127.0.0.1", 0), hostile_handler(layout.dim))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_host_answering_nan_is_refused_charged_quarantined_and_replaced(make_cluster, sqlite_url, hostile) -> None:
    url = hostile
    spec = load_job_spec(SPEC)
    assert spec.experts is not None
    cluster = make_cluster(sqlite_url)
    job_id = cluster.submit(spec.model_dump(mode="json"))["job_id"]
    stop = threading.Event()
    api = MixtureAPI(cluster.url, stop=stop)
    api.register(cluster.join_token, "hostile")
    with cluster.admin() as http:
        mixture = job_status(http, job_id)["mixture_id"]

        def beat() -> None:  # leases like an honest host, for as long as the scheduler lets it
            while not stop.wait(spec.experts.heartbeat_seconds):
                with contextlib.suppress(Refused):  # (a probe that fails while the test stops)
                    api.lease(mixture, url, 8)

        held = {lease.uid for lease in api.lease(mixture, url, 8).leases}
        threading.Thread(target=beat, daemon=True).start()
        experts = spec.experts.layers * spec.experts.experts_per_layer
        cluster.start_expert_host("honest", mixture, experts)

        def served() -> dict[str, str | None]:
            return {e["uid"]: e["url"] for e in http.get(f"/v1/mixtures/{mixture}").json()["experts"]}

        wait_for(lambda: all(served().values()), 120, "the experts were not all leased")
        cluster.start_client("trainer", tasks=1)
        try:
            # The trainer's first report charges the host; at 5 refused answers in a row it is quarantined
            # and its experts go to the honest host.
            wait_for(lambda: url not in served().values() and all(served().values()), 240, "never replaced")
            st = wait_finished(cluster, job_id)
        finally:
            stop.set()
        view = {e["uid"]: e for e in http.get(f"/v1/mixtures/{mixture}").json()["experts"]}
        hosts = {h["name"]: h for h in http.get("/v1/admin/hosts").json()}
    assert held and sum(view[uid]["refused"] for uid in held) >= 5
    assert all(view[uid]["leases"] >= 2 for uid in held)  # every one moved to the honest host
    bad = hosts["hostile"]
    assert bad["quarantined_until"] is not None and "answers refused by a trainer" in bad["quarantine_reason"]
    assert bad["credit"] == 0 and hosts["honest"]["credit"] > 0
    assert st["status"] == "succeeded", st["status_message"]
