"""Routes that FastAPI documents but answers without its per-request machinery.

FastAPI solves a route's dependencies and wraps its endpoint on every request; on the work route,
the scheduler's most frequent call, that cost as much CPU as the request's own SQL. A `LeanRoute`
keeps everything the route declares for the OpenAPI document (its body schema, its response
model, its security) and the app's middleware and exception handlers, but calls its endpoint with
the bare Request: the endpoint reads what it needs itself (crowdtrain.server.api.deps.host_call)
and returns the Response.
"""

from collections.abc import Awaitable, Callable
from typing import Any, cast

from fastapi import Request, Response
from fastapi.routing import APIRoute

LeanEndpoint = Callable[[Request], Awaitable[Response]]

# The OpenAPI security requirement of a route a host's bearer token admits (the scheme that
# crowdtrain.server.api.deps's HTTPBearer declares for every other host route).
HOST_TOKEN_SECURITY: dict[str, Any] = {"security": [{"HTTPBearer": []}]}


class LeanRoute(APIRoute):
    def get_route_handler(self) -> LeanEndpoint:  # type: ignore[override]
        return cast(LeanEndpoint, self.endpoint)
