"""The messages of `inference.GRPCInferenceService` (asyncgraph/serve/proto/inference.proto).

The .proto's compiled form (proto/inference_descriptor.py) is loaded into a descriptor pool
of its own (proto/__init__.py's ProtoFile says why), and the message classes are made from it.
The classes are ordinary protobuf messages: `FromString`, `SerializeToString`, fields by name.
"""

from __future__ import annotations

from typing import Any

from asyncgraph.serve.proto import SERVICE as SERVICE  # the service grpc_server.py serves
from asyncgraph.serve.proto import ProtoFile
from asyncgraph.serve.proto.inference_descriptor import SERIALIZED

_PROTO = ProtoFile(SERIALIZED)
FILE = _PROTO.file
_message = _PROTO.message


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
METHODS: dict[str, tuple[Any, Any, bool, bool]] = _PROTO.methods()
