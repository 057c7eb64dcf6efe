"""asyncgraph's inference.proto is the protocol's: every message and method it defines has
the names, numbers and types of tritonclient's own (Triton's grpc_service.proto), so the stock
clients talk to it; and the compiled form checked in is the .proto's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncgraph.serve import grpc_protocol as ours

tpb = pytest.importorskip("tritonclient.grpc.service_pb2")

ROOT = Path(__file__).resolve().parents[2]


def _shape(message: Any, seen: set[str] | None = None) -> dict[str, Any]:
    """A message's wire-relevant structure: fields by number, nested messages followed."""
    seen = set() if seen is None else seen
    if message.full_name in seen:
        return {"ref": message.full_name}
    seen.add(message.full_name)
    fields: dict[str, Any] = {}
    for field in message.fields:
        fields[str(field.number)] = {
            "name": field.name,
            "type": field.type,
            "repeated": field.is_repeated,
            "oneof": field.containing_oneof.name if field.containing_oneof else None,
            "message": _shape(field.message_type, seen) if field.message_type else None,
        }
    return {"name": message.full_name, "fields": fields}


@pytest.mark.parametrize("name", sorted(m.name for m in ours.FILE.message_types_by_name.values()))
def test_every_message_matches_tritonclients(name: str) -> None:
    mine = ours.FILE.message_types_by_name[name]
    theirs = tpb.DESCRIPTOR.message_types_by_name[name]
    assert _shape(mine) == _shape(theirs)


def test_every_method_matches_tritonclients() -> None:
    theirs = tpb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    mine = ours.FILE.services_by_name["GRPCInferenceService"]
    assert mine.full_name == ours.SERVICE == theirs.full_name
    for method in mine.methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            other.input_type.full_name, other.output_type.full_name
        )
        assert (method.client_streaming, method.server_streaming) == (
            other.client_streaming, other.server_streaming
        )
    assert set(ours.METHODS) == {
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
        "ModelInfer", "ModelStreamInfer", "RepositoryIndex", "RepositoryModelLoad",
        "RepositoryModelUnload",
    }


def test_messages_cross_the_wire_both_ways() -> None:
    request = tpb.ModelInferRequest(model_name="m", id="7", raw_input_contents=[b"\1\2"])
    request.parameters["timeout"].int64_param = 5
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    mine = ours.ModelInferRequest.FromString(request.SerializeToString())
    assert mine.parameters["timeout"].int64_param == 5
    assert list(mine.inputs[0].contents.fp32_contents) == [1.0, 2.0]
    assert tpb.ModelInferRequest.FromString(mine.SerializeToString()) == request


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="no grpcio-tools")
def test_the_compiled_proto_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_grpc_protocol.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
