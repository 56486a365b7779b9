"""The scheduler's HTTP transport: uvicorn's httptools protocol with `TCP_NODELAY` on every accepted
socket.

With `--workers N`, uvicorn binds the listening socket in the parent and hands it to the workers; the
accepted sockets then do not get `TCP_NODELAY` from the event loop (it checks the socket's protocol
number, which the handed-over socket lacks), and each keep-alive answer waits for the client's delayed
ACK: about 40 ms, one sequential client served 17 requests a second instead of about 100. Setting the
option on each connection makes the worker count irrelevant to latency.

Idle keep-alive connections are kept `KEEP_ALIVE_S`, not uvicorn's default 5 s: a client's pool
(httpx's, 5 s) must be the side that gives a connection up first, or a request it sends on a
connection it may still use meets the server closing it ("Server disconnected without sending a
response"). uvicorn's loop (uvloop) runs its expired timers before reading sockets, so with 5 s a
scheduler left unscheduled for a few seconds on a loaded machine closed connections whose next request
was already waiting. 75 s is also above the idle timeout of common load balancers (60 s), for the same
reason one hop further out.
"""

import asyncio
import contextlib
import socket

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

KEEP_ALIVE_S = 75


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
