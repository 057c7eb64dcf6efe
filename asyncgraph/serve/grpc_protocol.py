"""The messages of `inference.GRPCInferenceService` (asyncgraph/serve/proto/inference.proto).

The .proto's compiled form (a serialized FileDescriptorProto, proto/inference_descriptor.py,
made by scripts/gen_grpc_protocol.py) is loaded into a descriptor pool of this module's own,
and the message classes are made from it. Not protoc's `_pb2` modules in the default pool:
those register `inference.ModelInferRequest` and the rest process-wide, and tritonclient's
own `service_pb2` registers the same names from another file, so a process that imports both
(a test, an application that also calls a Triton server) would fail with "duplicate symbol".
The classes are ordinary protobuf messages: `FromString`, `SerializeToString`, fields by name.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from asyncgraph.serve.proto.inference_descriptor import SERIALIZED

SERVICE = "inference.GRPCInferenceService"

_POOL = descriptor_pool.DescriptorPool()
FILE = _POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(SERIALIZED))


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"inference.{name}"))


ServerLiveRequest = _message("ServerLiveRequest")
ServerLiveResponse = _message("ServerLiveResponse")
ServerReadyRequest = _message("ServerReadyRequest")
ServerReadyResponse = _message("ServerReadyResponse")
ModelReadyRequest = _message("ModelReadyRequest")
ModelReadyResponse = _message("ModelReadyResponse")
ServerMetadataRequest = _message("ServerMetadataRequest")
ServerMetadataResponse = _message("ServerMetadataResponse")
ModelMetadataRequest = _message("ModelMetadataRequest")
ModelMetadataResponse = _message("ModelMetadataResponse")
ModelInferRequest = _message("ModelInferRequest")
ModelInferResponse = _message("ModelInferResponse")
ModelStreamInferResponse = _message("ModelStreamInferResponse")
InferParameter = _message("InferParameter")
InferTensorContents = _message("InferTensorContents")
RepositoryIndexResponse = _message("RepositoryIndexResponse")
RepositoryModelLoadResponse = _message("RepositoryModelLoadResponse")
RepositoryModelUnloadResponse = _message("RepositoryModelUnloadResponse")

#: method name -> (request class, response class, client streaming, server streaming)
METHODS: dict[str, tuple[Any, Any, bool, bool]] = {}
for _method in _POOL.FindServiceByName(SERVICE).methods:
    METHODS[_method.name] = (
        _message(_method.input_type.name), _message(_method.output_type.name),
        _method.client_streaming, _method.server_streaming,
    )
