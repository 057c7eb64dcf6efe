"""Triton's statistics and shared memory extensions over HTTP (gRPC: grpc_extensions.py).

    GET  /v2/models/stats                                  every model version served
    GET  /v2/models/{m}/stats, /v2/models/{m}/versions/{v}/stats
    GET  /v2/systemsharedmemory[/region/{r}]/status
    POST /v2/systemsharedmemory/region/{r}/register        {"key", "offset", "byte_size"}
    POST /v2/systemsharedmemory[/region/{r}]/unregister
    GET  /v2/cudasharedmemory[/region/{r}]/status          no regions
    POST /v2/cudasharedmemory/region/{r}/register          refused (shared_memory.CUDA_REFUSED)
    POST /v2/cudasharedmemory[/region/{r}]/unregister      nothing to do

`/v2/models/stats` is the statistics of every model, as Triton reads it, not the metadata of a
model named "stats": `statistics_routes` go before the model routes. The figures are
statistics.py's, the regions shared_memory.py's; errors are the protocol's
(`{"error": ...}`, app.py's handler), each naming the model, version or region.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncgraph.serve.core import InferenceServer
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.shared_memory import CUDA_REFUSED
from asyncgraph.serve.statistics import model_statistics

#: A register request's body is a small JSON object: larger ones get 413.
MAX_REGISTER_BYTES = 64 << 10


def statistics_routes(server: InferenceServer) -> list[Route]:
    """The statistics extension's routes (before the model routes: see the docstring)."""

    async def statistics(request: Request) -> Response:
        params = request.path_params
        return JSONResponse(model_statistics(server, params.get("name"), params.get("version")))

    return [
        Route("/v2/models/stats", statistics, methods=["GET"]),
        Route("/v2/models/{name}/stats", statistics, methods=["GET"]),
        Route("/v2/models/{name}/versions/{version}/stats", statistics, methods=["GET"]),
    ]


def shared_memory_routes(server: InferenceServer) -> list[Route]:
    """The system (and refused CUDA) shared memory extensions' routes."""
    memory = server.shared_memory

    async def status(request: Request) -> Response:
        return JSONResponse(memory.status(request.path_params.get("region")))

    async def register(request: Request) -> Response:
        name = request.path_params["region"]
        body = await _register_body(request, f"shared memory region {name!r}")
        memory.register(name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
        return Response(status_code=200)

    async def unregister(request: Request) -> Response:
        memory.unregister(request.path_params.get("region"))
        return Response(status_code=200)

    async def cuda_status(request: Request) -> Response:
        name = request.path_params.get("region")
        if name is not None:
            raise ProtocolError(
                f"CUDA shared memory region {name!r} is not registered: {CUDA_REFUSED}", 404)
        return JSONResponse([])

    async def cuda_register(request: Request) -> Response:
        raise ProtocolError(
            f"CUDA shared memory region {request.path_params['region']!r}: {CUDA_REFUSED}")

    async def cuda_unregister(request: Request) -> Response:
        return Response(status_code=200)  # none is ever registered

    system = "/v2/systemsharedmemory"
    cuda = "/v2/cudasharedmemory"
    return [
        Route(system + "/status", status, methods=["GET"]),
        Route(system + "/region/{region}/status", status, methods=["GET"]),
        Route(system + "/region/{region}/register", register, methods=["POST"]),
        Route(system + "/unregister", unregister, methods=["POST"]),
        Route(system + "/region/{region}/unregister", unregister, methods=["POST"]),
        Route(cuda + "/status", cuda_status, methods=["GET"]),
        Route(cuda + "/region/{region}/status", cuda_status, methods=["GET"]),
        Route(cuda + "/region/{region}/register", cuda_register, methods=["POST"]),
        Route(cuda + "/unregister", cuda_unregister, methods=["POST"]),
        Route(cuda + "/region/{region}/unregister", cuda_unregister, methods=["POST"]),
    ]


async def _register_body(request: Request, where: str) -> dict[str, Any]:
    """A register request's JSON object, read within MAX_REGISTER_BYTES."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REGISTER_BYTES:
            raise ProtocolError(
                f"{where}: register request body over {MAX_REGISTER_BYTES} bytes", 413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{where}: register request body: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: register request body: expected a JSON object")
    return body
