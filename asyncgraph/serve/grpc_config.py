"""The gRPC methods of Triton's model configuration extension (`ModelConfig`), beside
grpc_server.py's service: a handler of its own for the same service name, so
`inference.GRPCInferenceService/ModelConfig` answers with model_config.py's messages
(proto/model_config.proto) without changing the inference service's own proto."""

from __future__ import annotations

from typing import Any

import grpc

from asyncgraph.serve.core import InferenceServer
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.grpc_protocol import SERVICE
from asyncgraph.serve.model_config import (
    ModelConfigRequest,
    ModelConfigResponse,
    config_message,
    model_config,
)


def config_handler(
    server: InferenceServer, abort: Any,
) -> grpc.GenericRpcHandler:
    """`ModelConfig` over `server`; `abort(context, ProtocolError)` answers a refusal with its
    gRPC status (grpc_server's, so both map statuses alike)."""

    async def ModelConfig(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            config = model_config(server, request.name, request.version or None)
        except ProtocolError as exc:
            await abort(context, exc)
        return ModelConfigResponse(config=config_message(config))

    handler = grpc.unary_unary_rpc_method_handler(
        ModelConfig, request_deserializer=ModelConfigRequest.FromString,
        response_serializer=ModelConfigResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"ModelConfig": handler})
