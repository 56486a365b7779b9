"""A local stand-in for a cloud's spot-interruption notice, for the tests and benchmarks of preemption."""

import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class SpotNoticeServer:
    """A local stand-in for the cloud metadata service's spot-interruption notice (AWS IMDSv2).

    PUT /latest/api/token hands out a session token; GET /latest/meta-data/spot/instance-action
    answers 404 until `announce()` is called, then the notice as JSON (only with a valid token).
    """

    TOKEN = "local-imds-token"

    def __init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, SpotNoticeServer.TOKEN.encode())
                else:
                    self._send(400)

            def do_GET(self) -> None:
                if self.headers.get("X-aws-ec2-metadata-token") != SpotNoticeServer.TOKEN:
                    self._send(401)
                elif self.path != "/latest/meta-data/spot/instance-action" or server.notice is None:
                    self._send(404)
                else:
                    server.served_at = server.served_at or time.time()
                    self._send(200, json.dumps(server.notice).encode())

        self.notice: dict | None = None
        self.served_at: float | None = None  # when a client first read the notice
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/latest/meta-data/spot/instance-action"

    def announce(self, seconds_left: float, action: str = "terminate") -> float:
        """Start serving a notice that the instance goes away in `seconds_left`; returns that time."""
        at = time.time() + seconds_left
        self.notice = {"action": action, "time": datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        return at

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
