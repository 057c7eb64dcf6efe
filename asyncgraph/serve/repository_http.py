"""The HTTP routes of Triton's model repository extension (model_control.py does the work):

    POST /v2/repository/index               {"ready": bool}? -> [{name, version, state, reason}]
    POST /v2/repository/models/NAME/load    {"parameters": {}}? -> 200, empty body
    POST /v2/repository/models/NAME/unload  {"parameters": {"unload_dependents": b}}? -> 200

Bodies are optional (empty or `{}`); errors are the protocol's `{"error": "..."}`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncgraph.serve.errors import ProtocolError

Index = Callable[[bool], list[dict[str, str]]]
Action = Callable[[str, Mapping[str, Any]], Awaitable[None]]

#: A model control request's body is a small JSON object: more is refused unread.
MAX_BODY_BYTES = 64 << 10


async def _body(request: Request, allowed: set[str]) -> dict[str, Any]:
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ProtocolError(f"request body: over {MAX_BODY_BYTES} bytes", 413)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"request body: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"request body: expected a JSON object, got {type(body).__name__}")
    for key in body:
        if key not in allowed:
            raise ProtocolError(f"request body: unknown field {key!r}; expected "
                                f"{', '.join(sorted(allowed))}")
    return body


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ProtocolError("parameters: expected an object")
    return parameters


def repository_routes(repository_index: Index, load_model: Action,
                      unload_model: Action) -> list[Route]:
    """The routes, answering with `InferenceServer`'s repository_index, load_model and
    unload_model (passed in: this module imports neither app.py nor model_control.py)."""

    async def index(request: Request) -> Response:
        body = await _body(request, {"ready"})
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise ProtocolError(f"ready: expected a boolean, got {ready!r}")
        return JSONResponse(repository_index(ready))

    async def load(request: Request) -> Response:
        body = await _body(request, {"parameters"})
        await load_model(request.path_params["name"], _parameters(body))
        return Response(status_code=200)

    async def unload(request: Request) -> Response:
        body = await _body(request, {"parameters"})
        await unload_model(request.path_params["name"], _parameters(body))
        return Response(status_code=200)

    models = "/v2/repository/models/{name}"
    return [
        Route("/v2/repository/index", index, methods=["POST"]),
        Route(models + "/load", load, methods=["POST"]),
        Route(models + "/unload", unload, methods=["POST"]),
    ]
