"""Triton's statistics and shared memory extensions over gRPC: ModelStatistics,
SystemSharedMemory{Status,Register,Unregister} and CudaSharedMemory{Status,Register,Unregister}
of `inference.GRPCInferenceService`, beside the methods grpc_server.py serves.

Their messages are Triton's (proto/extensions.proto: the same names and field numbers as
Triton's grpc_service.proto, so tritonclient's stubs call them), loaded into a descriptor
pool of their own (proto/__init__.py's ProtoFile), as inference.proto's are. The answers are the
ones HTTP gives (triton_http.py): statistics.model_statistics as a ModelStatisticsResponse,
the server's SystemSharedMemory (shared_memory.py), and CUDA shared memory refused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import json_format

from asyncgraph.serve.core import InferenceServer
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.proto import SERVICE, ProtoFile
from asyncgraph.serve.proto.extensions_descriptor import SERIALIZED
from asyncgraph.serve.shared_memory import CUDA_REFUSED
from asyncgraph.serve.statistics import model_statistics

_PROTO = ProtoFile(SERIALIZED)
FILE = _PROTO.file
#: method name -> (request class, response class), all unary
METHODS: dict[str, tuple[Any, Any]] = {
    name: (request, response) for name, (request, response, _, _) in _PROTO.methods().items()
}

#: How a handler answers a failed call with a ProtocolError (grpc_server._abort: its gRPC
#: code from the HTTP status, as every other method's).
Abort = Callable[[grpc.aio.ServicerContext, ProtocolError], Awaitable[NoReturn]]


class ExtensionService:
    """The extensions' handlers over an InferenceServer."""

    def __init__(self, server: InferenceServer, abort: Abort) -> None:
        self.server = server
        self.abort = abort

    async def ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            answer = model_statistics(
                self.server, request.name or None, request.version or None
            )
        except ProtocolError as exc:
            await self.abort(context, exc)
        return json_format.ParseDict(answer, METHODS["ModelStatistics"][1]())

    async def SystemSharedMemoryStatus(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            regions = self.server.shared_memory.status(request.name or None)
        except ProtocolError as exc:
            await self.abort(context, exc)
        response = METHODS["SystemSharedMemoryStatus"][1]()
        for region in regions:
            response.regions[region["name"]].CopyFrom(
                response.RegionStatus(**region))
        return response

    async def SystemSharedMemoryRegister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self.server.shared_memory.register(
                request.name, request.key, request.offset, request.byte_size
            )
        except ProtocolError as exc:
            await self.abort(context, exc)
        return METHODS["SystemSharedMemoryRegister"][1]()

    async def SystemSharedMemoryUnregister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        self.server.shared_memory.unregister(request.name or None)
        return METHODS["SystemSharedMemoryUnregister"][1]()

    async def CudaSharedMemoryStatus(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        if request.name:
            await self.abort(context, ProtocolError(
                f"CUDA shared memory region {request.name!r} is not registered: "
                f"{CUDA_REFUSED}", 404))
        return METHODS["CudaSharedMemoryStatus"][1]()

    async def CudaSharedMemoryRegister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        await self.abort(context, ProtocolError(
            f"CUDA shared memory region {request.name!r}: {CUDA_REFUSED}"))

    async def CudaSharedMemoryUnregister(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        return METHODS["CudaSharedMemoryUnregister"][1]()  # none is ever registered


def extensions_handler(server: InferenceServer, abort: Abort) -> grpc.GenericRpcHandler:
    """The extensions' methods as one grpc handler, beside grpc_server's (grpc asks each
    handler in turn for a method)."""
    service = ExtensionService(server, abort)
    handlers = {
        method: grpc.unary_unary_rpc_method_handler(
            getattr(service, method), request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
        for method, (request, response) in METHODS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
