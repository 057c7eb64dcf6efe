"""The protocol's .proto files and their compiled forms (`*_descriptor.py`, written by
scripts/gen_grpc_protocol.py), and `ProtoFile`, which makes message classes from one.

Each compiled file is loaded into a descriptor pool of its own, not protoc's `_pb2` modules in
the default pool: those register `inference.ModelInferRequest` and the rest process-wide, and
tritonclient's own `service_pb2` registers the same names from another file, so a process that
imports both (a test, an application that also calls a Triton server) would fail with
"duplicate symbol".
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = "inference.GRPCInferenceService"


class ProtoFile:
    """One compiled .proto in a descriptor pool of its own: its messages by name, and the
    methods it declares for the inference service."""

    def __init__(self, serialized: bytes) -> None:
        self.pool = descriptor_pool.DescriptorPool()
        self.file = self.pool.Add(descriptor_pb2.FileDescriptorProto.FromString(serialized))

    def message(self, name: str) -> Any:
        """The class of message `inference.<name>`."""
        return message_factory.GetMessageClass(
            self.pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))

    def methods(self) -> dict[str, tuple[Any, Any, bool, bool]]:
        """Method name -> (request class, response class, client streaming, server
        streaming), for the service methods this file declares."""
        return {
            m.name: (self.message(m.input_type.name), self.message(m.output_type.name),
                     m.client_streaming, m.server_streaming)
            for m in self.pool.FindServiceByName(SERVICE).methods
        }
