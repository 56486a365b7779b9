"""An expert host: serves its experts' forward and backward calls over HTTP (Starlette on uvicorn).

    POST /v1/experts/{uid}/forward    body: x [rows, dim]            -> y [rows, dim]
    POST /v1/experts/{uid}/backward   body: x, grad_y [rows, dim]    -> grad_x [rows, dim]
    GET  /v1/experts                  the layout and each expert's figures (JSON)
    GET  /v1/health

Bodies are safetensors (crowdtrain.core.experts.read_call). A body is bounded before it is read (413),
then checked (400 not safetensors, 422 wrong names, shapes, dtype, rows or non-finite values, 404 an
expert this host does not serve). A call that the expert cannot answer (ExpertFailed, or any error of
its batch) gets 503 for that call alone: the host and its other experts go on serving. The calls of
each expert are batched (crowdtrain.client.experts.batching).
"""

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from crowdtrain.client.experts.batching import BatchQueue
from crowdtrain.client.experts.expert import Expert
from crowdtrain.core.experts import BACKWARD_ARGS, FORWARD_ARGS, ExpertLayout, encode_call, layout_has, read_call
from crowdtrain.core.tensors import TensorFormatError

log = logging.getLogger(__name__)
TENSORS = "application/octet-stream"


class _TooLarge(Exception):
    pass


@dataclass
class Served:
    """One expert with its two queues."""

    expert: Expert
    forward: BatchQueue
    backward: BatchQueue
    failures: int = 0


def _problem(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


async def _bounded_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _TooLarge(f"a call's body is at most {limit} bytes; this one says {declared[:20]}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _TooLarge(f"a call's body is at most {limit} bytes")
    return bytes(body)


async def _read(request: Request, layout: ExpertLayout, args: tuple[str, ...]) -> dict[str, np.ndarray] | Response:
    """The call's tensors, or the 4xx answer that says what is wrong with its body."""
    try:
        body = await _bounded_body(request, layout.call_limit(args))
        return read_call(body, args, layout.dim, layout.max_rows)
    except _TooLarge as exc:
        return _problem(413, str(exc))
    except TensorFormatError as exc:
        return _problem(400, str(exc))
    except ValueError as exc:
        return _problem(422, str(exc))


@dataclass
class InjectedNetwork:
    """A wide-area network laid over the host's answers, for benchmarks: each call waits an exponential
    delay of mean `latency` seconds, and a share `drop_rate` of them is lost (its caller waits
    `drop_hold` seconds for an answer that is an error). Off by default."""

    latency: float = 0.0
    drop_rate: float = 0.0
    drop_hold: float = 2.0
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    async def lost(self) -> bool:
        """Wait out this call's delay; whether the call is lost (after holding its caller)."""
        if self.drop_rate and self.rng.random() < self.drop_rate:
            await asyncio.sleep(self.drop_hold)
            return True
        if self.latency:
            await asyncio.sleep(self.rng.exponential(self.latency))
        return False


class ExpertHost:
    """The experts this host serves, of one `layout`, and the calls they answer. Experts come and go
    while it serves (`add`, `remove`: a leasing host's leases, crowdtrain.client.experts.leasing)."""

    def __init__(
        self,
        layout: ExpertLayout,
        uids: Sequence[str] = (),
        batch_window: float = 0.005,
        network: InjectedNetwork | None = None,
    ):
        self.layout, self.batch_window = layout, batch_window
        self.network = network or InjectedNetwork()
        self.served: dict[str, Served] = {}
        for uid in uids:
            self.add(Expert(layout, uid))

    def add(self, expert: Expert) -> None:
        """Serve `expert` (in place of any expert of its id)."""
        if not layout_has(self.layout, expert.uid):
            raise ValueError(
                f"expert {expert.uid!r} is not in the layout (layers {self.layout.layers}, grid {self.layout.grid})"
            )
        self.served[expert.uid] = Served(
            expert,
            BatchQueue(expert.forward, self.batch_window, self.layout.max_rows),
            BatchQueue(expert.backward, self.batch_window, self.layout.max_rows),
        )

    def remove(self, uid: str) -> None:
        """Stop serving expert `uid`: its next calls get 404, as for any expert this host does not serve."""
        self.served.pop(uid, None)

    async def call(self, request: Request) -> Response:
        uid, kind = request.path_params["uid"], request.path_params["kind"]
        if kind not in ("forward", "backward"):
            return _problem(404, f"no call {kind[:20]!r}: forward or backward")
        entry = self.served.get(uid)
        if entry is None:
            return _problem(404, f"this host does not serve expert {uid[:40]!r}")
        args = FORWARD_ARGS if kind == "forward" else BACKWARD_ARGS
        tensors = await _read(request, self.layout, args)
        if isinstance(tensors, Response):
            return tensors
        if await self.network.lost():
            return _problem(503, "the call was lost (injected)")
        queue = entry.forward if kind == "forward" else entry.backward
        try:
            out: np.ndarray = await queue.call(*(tensors[a] for a in args))
        except Exception as exc:
            entry.failures += 1
            log.warning("expert %s: %s failed (%s: %s); the host goes on", uid, kind, type(exc).__name__, exc)
            return _problem(503, f"expert {uid} failed: {exc}")
        return Response(encode_call(**{"y" if kind == "forward" else "grad_x": out}), media_type=TENSORS)

    async def experts(self, request: Request) -> JSONResponse:
        figures = {
            uid: {
                "steps": e.expert.steps,
                "forward_batches": e.forward.batches,
                "backward_batches": e.backward.batches,
                "failures": e.failures,
            }
            for uid, e in self.served.items()
        }
        return JSONResponse({"layout": self.layout.model_dump(mode="json"), "experts": figures})

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "experts": len(self.served)})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/experts/{uid}/{kind}", self.call, methods=["POST"]),
                Route("/v1/experts", self.experts, methods=["GET"]),
                Route("/v1/health", self.health, methods=["GET"]),
            ]
        )
