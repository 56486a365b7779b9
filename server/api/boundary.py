"""The scheduler's HTTP boundary: what a request may make it hold, and the one shape of every error.

- Every request body is bounded before it is parsed: JSON bodies by `body_max_bytes` (declared
  length first, then while streaming); upload bodies (the PUT routes) by `upload_max_bytes`, read by
  `upload_body` only once the route knows who is uploading, and at most `upload_slots` at a time;
  dataset uploads by `dataset_max_bytes`, streamed to a file by `receive_to_file`.
- Every error answers `ErrorOut` ({"detail": str}), as the OpenAPI document says; validation errors
  name the field and the problem and never echo the input back.
- A `Refusal` raised anywhere below a route (crowdtrain.core.refusals) is answered here, with the
  status code REFUSAL_STATUS gives its kind: routes do not translate refusals themselves.
- Redis unreachable (down, restarting, loading its data) is answered 503 with `Retry-After`, not
  500: the request may succeed as it is once Redis is back, and the clients retry a 503.
"""

import hashlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO, Any, TypeVar

import redis
from fastapi import FastAPI, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from crowdtrain.core.refusals import Refusal, RefusalKind
from crowdtrain.core.schemas import ErrorOut, Id

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

# The one translation of the domain's refusals into HTTP.
REFUSAL_STATUS: dict[RefusalKind, int] = {
    RefusalKind.malformed: status.HTTP_400_BAD_REQUEST,
    RefusalKind.unauthenticated: status.HTTP_401_UNAUTHORIZED,
    RefusalKind.forbidden: status.HTTP_403_FORBIDDEN,
    RefusalKind.not_found: status.HTTP_404_NOT_FOUND,
    RefusalKind.conflict: status.HTTP_409_CONFLICT,
    RefusalKind.unacceptable: status.HTTP_422_UNPROCESSABLE_CONTENT,
    RefusalKind.throttled: status.HTTP_429_TOO_MANY_REQUESTS,
}
ERROR_RESPONSES: dict[int | str, dict] = {
    "4XX": {"model": ErrorOut, "description": "The request was refused; `detail` says why"},
}
# Seconds a caller waits before retrying while Redis is unreachable: about what a restart takes.
REDIS_RETRY_AFTER = 5
UPLOAD_RESPONSES: dict[int | str, dict] = {
    503: {"model": ErrorOut, "description": "Too many uploads at once: retry after `Retry-After` seconds"},
}


def octet_stream_body(description: str) -> dict:
    """`openapi_extra` of a route that reads its body itself: a required application/octet-stream body."""
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    }


def json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` of a route that parses its JSON body itself (`parse_json_body`): the body `model`
    describes, required."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: object) -> object:  # the models' own definitions, in place of references to them
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def parse_json_body(model: type[M], body: bytes) -> M:
    """A JSON request body as `model`, refused as FastAPI refuses a body it parses (422, RequestValidationError)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)], body=body
        ) from None


_ID: TypeAdapter[int] = TypeAdapter(Id)


def path_id(name: str, raw: str) -> int:
    """A path parameter as an Id (crowdtrain.core.schemas.Id), refused as FastAPI refuses one it
    parses (422, RequestValidationError naming `path.<name>`): for a LeanRoute, which parses its own."""
    try:
        return int(_ID.validate_python(raw))
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("path", name, *e["loc"])} for e in exc.errors(include_url=False)]
        ) from None


def path_parameter(name: str, annotation: Any) -> dict[str, Any]:
    """The OpenAPI declaration of a required path parameter of type `annotation`, for a LeanRoute
    (whose endpoint takes the bare Request, so FastAPI cannot see its parameters)."""
    schema = TypeAdapter(annotation).json_schema()
    return {"parameters": [{"name": name, "in": "path", "required": True, "schema": schema}]}


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, declared: int | None = None):
        size = f"of {declared} bytes " if declared is not None else ""
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, f"body {size}exceeds the limit of {limit} bytes")


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class BodyLimit:
    """ASGI wrapper: a body longer than `max_bytes` is refused with 413 before it is read whole.

    Methods in `exempt` (the upload PUTs) are left to `upload_body`, which knows the assignment.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = ("PUT",)):
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in self.exempt:
            return await self.app(scope, receive, send)
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            response = _error_response(BodyTooLarge(self.max_bytes, declared))
            return await response(scope, receive, send)
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)  # answered by the app's HTTPException handler
            return message

        await self.app(scope, bounded, send)


class UploadSlots:
    """How many upload bodies this process holds at once. Used from the event loop only: no lock."""

    def __init__(self, slots: int, retry_after: int):
        self.free, self.retry_after = slots, retry_after

    @asynccontextmanager
    async def body(self, request: Request, limit: int) -> AsyncIterator[bytes]:
        """The request body, at most `limit` bytes, held in one of the slots (503 when none is free)."""
        if self.free <= 0:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                "too many uploads at once; retry later",
                headers={"Retry-After": str(self.retry_after)},
            )
        self.free -= 1
        try:
            yield await _read_limited(request, limit)
        finally:
            self.free += 1


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def receive_to_file(request: Request, file: IO[bytes], limit: int) -> tuple[str, int]:
    """Stream the request body into `file`, at most `limit` bytes (413 beyond: the declared length
    first, then while streaming), never holding more than one chunk. Returns its sha256 and size."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit, int(declared))
    digest, size = hashlib.sha256(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        digest.update(chunk)
        await run_in_threadpool(file.write, chunk)
    await run_in_threadpool(file.flush)
    return digest.hexdigest(), size


async def fixed_chunks(request: Request, chunk_bytes: int, length: int) -> AsyncIterator[bytearray]:
    """The request body cut into chunks of `chunk_bytes` (the last one shorter), holding one at a
    time; the body must be exactly `length` bytes (413 beyond it, 400 when it ends short). Each
    piece received is copied once, into the chunk it belongs to; a chunk yielded is the caller's."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > length:
        raise BodyTooLarge(length, int(declared))
    chunk, filled, size = bytearray(min(chunk_bytes, length)), 0, 0
    async for piece in request.stream():
        size += len(piece)
        if size > length:
            raise BodyTooLarge(length)
        view = memoryview(piece)
        while view:
            take = min(len(view), len(chunk) - filled)
            chunk[filled : filled + take] = view[:take]
            filled, view = filled + take, view[take:]
            if filled == len(chunk):
                yield chunk
                chunk, filled = bytearray(min(chunk_bytes, length - size + len(view))), 0
    if size != length:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"body ended after {size} of its {length} bytes")


def upload_body(request: Request, limit: int):
    """`async with upload_body(request, limit) as body:` through the app's UploadSlots."""
    return request.app.state.upload_slots.body(request, limit)


def describe_validation(errors: list[dict], limit: int = 2000) -> str:
    """'where: what' for each error, without the input (which may be huge or a secret)."""
    parts = []
    for e in errors[:10]:
        where = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{where}: {str(e.get('msg', 'invalid'))[:300]}")
    more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
    return ("; ".join(parts) + more)[:limit]


def _error_response(exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)[:2000]
    return JSONResponse(
        ErrorOut(detail=detail).model_dump(), status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return _error_response(exc)


def refusal_response(refusal: Refusal) -> JSONResponse:
    """A refusal's answer: its kind's status code, its message as `detail`, and the headers the code
    calls for (a Bearer challenge with 401, `Retry-After` when the refusal names one)."""
    headers = {}
    if refusal.kind is RefusalKind.unauthenticated:
        headers["WWW-Authenticate"] = "Bearer"
    if refusal.retry_after is not None:
        headers["Retry-After"] = str(refusal.retry_after)
    return JSONResponse(
        ErrorOut(detail=refusal.message[:2000]).model_dump(),
        status_code=REFUSAL_STATUS[refusal.kind],
        headers=headers or None,
    )


async def _on_refusal(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Refusal)
    return refusal_response(exc)


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(
        ErrorOut(detail=describe_validation(list(exc.errors()))).model_dump(),
        status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
    )


async def _on_redis_unreachable(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, redis.ConnectionError | redis.TimeoutError)
    log.warning("%s %s: answered 503: Redis is unreachable: %s", request.method, request.url.path, exc)
    return JSONResponse(
        ErrorOut(
            detail="the scheduler's parameter store (Redis) is unreachable: "
            f"the server is restarting or degraded; retry in {REDIS_RETRY_AFTER} s"
        ).model_dump(),
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": str(REDIS_RETRY_AFTER)},
    )


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(ErrorOut(detail="internal error").model_dump(), status_code=500)


def install(app: FastAPI, body_max_bytes: int, upload_slots: int, upload_retry_after: int) -> None:
    """Bound the app's bodies and answer every error (refusals included) as ErrorOut."""
    app.state.upload_slots = UploadSlots(upload_slots, upload_retry_after)
    app.add_middleware(BodyLimit, max_bytes=body_max_bytes)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(Refusal, _on_refusal)
    app.add_exception_handler(redis.ConnectionError, _on_redis_unreachable)
    app.add_exception_handler(redis.TimeoutError, _on_redis_unreachable)
    app.add_exception_handler(Exception, _on_unexpected)
