"""A one-route HTTP server for tests: a function of (method, path, body) served on a free port of
127.0.0.1 from a thread, for as long as a `with` block lasts. Expert hosts that lie, or that only
answer the scheduler's connect-back probe, are written as such functions."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Reply = tuple[int, bytes]
Handle = Callable[[str, str, bytes], Reply]  # (method, path, body) -> (status, body)
OK = (200, b'{"status": "ok"}')


def healthy(_method: str, path: str, _body: bytes) -> Reply:
    """A host that answers its health check (the scheduler's connect-back probe) and nothing else."""
    return OK if path == "/v1/health" else (404, b"")


@contextmanager
def stub_server(handle: Handle) -> Iterator[str]:
    """Serve `handle` until the block ends; yields the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, out = handle(self.command, self.path, body)
            self.send_response(status)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PUT = _serve

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
