"""gRPC inference requests and responses: `ModelInferRequest` in, `ModelInferResponse` out.

A request is turned into the protocol's input and output entries (what a JSON body holds) and
checked and decoded by the same code as HTTP's (`codec.decode_entries`): names, datatypes,
every dimension against the signature, sizes, ranges, before a tensor is made; error messages
name the field at fault (`inputs[0] ('x').raw_input_contents`).

Input values come one of two ways, as Triton takes them:

- `raw_input_contents`: one buffer per input, in the order of `inputs`, little-endian,
  row-major (what tritonclient.grpc sends): each is the input's binary data;
- `contents`: the typed field of the input's datatype (`fp32_contents` for FP32,
  `int_contents` for INT8/INT16/INT32, ...; FP16 and BF16 have none and go raw).

An input in a system shared memory region (parameters `shared_memory_region`, ...:
shared_memory.py) has neither: `raw_input_contents` then holds one buffer per input not in a
region, in order, as tritonclient sends them. An output asked into a region is written there
and answered without contents (an empty raw buffer in its place).

The response answers in kind: raw outputs (`raw_output_contents`) when the request used raw
inputs (or has none), typed `contents` otherwise, except that a response with an FP16 or
BF16 output, which has no typed field, is raw. A typed response is checked against
--max-response-bytes at its worst-case encoded size (`response_bytes`): protobuf packs
integers as varints, and a negative INT8 takes 10 bytes where its raw form takes 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from asyncgraph.serve import codec
from asyncgraph.serve import datatypes as dt
from asyncgraph.serve import grpc_protocol as pb
from asyncgraph.serve.codec import InferRequest, decode_entries, encode_output, write_to_region
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.interface import ModelInterface
from asyncgraph.serve.shared_memory import Lease

#: The typed contents field of each datatype (FP16 and BF16 have none: raw only).
TYPED_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}

#: The numpy type a typed field's values arrive in.
FIELD_DTYPES: dict[str, Any] = {
    "bool_contents": np.bool_, "int_contents": np.int32, "int64_contents": np.int64,
    "uint_contents": np.uint32, "uint64_contents": np.uint64, "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}
_ALL_FIELDS = (*FIELD_DTYPES, "bytes_contents")

#: The most bytes one value of each datatype takes in its typed contents field on the wire:
#: integers are packed varints (7 bits a byte; a negative int32 is sign-extended to 64 bits,
#: 10 bytes), floats fixed-size.
TYPED_VALUE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "INT8": 10, "INT16": 10, "INT32": 10, "INT64": 10,
    "UINT8": 2, "UINT16": 3, "UINT32": 5, "UINT64": 10,
    "FP32": 4,
    "FP64": 8,
}


def parameters_of(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A `map<string, InferParameter>` as the dict a JSON request's `parameters` is."""
    out: dict[str, Any] = {}
    for key, value in parameters.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(value, which)
    return out


def decode_infer_request(
    message: Any, iface: ModelInterface, regions: Lease | None = None
) -> tuple[InferRequest, bool]:
    """The decoded request (codec.InferRequest) and whether it should be answered raw.
    `regions`: the request's lease on the server's shared memory regions (shared_memory.py):
    an input naming one has no contents and no raw_input_contents buffer of its own."""
    raw = message.raw_input_contents
    inputs = message.inputs
    in_region = ["shared_memory_region" in t.parameters for t in inputs]
    plain = len(inputs) - sum(in_region)
    if raw and len(raw) != plain:
        besides = " not in shared memory" if plain != len(inputs) else ""
        raise ProtocolError(
            f"raw_input_contents: {len(raw)} buffer(s) for {plain} input(s){besides}; give "
            f"one per input, in the order of inputs, or none (typed contents)"
        )
    entries: list[dict[str, Any]] = []
    buffers = iter(enumerate(raw))
    typed = False
    for i, tensor in enumerate(inputs):
        entry: dict[str, Any] = {
            "name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
            "parameters": parameters_of(tensor.parameters),
        }
        where = f"inputs[{i}] ({tensor.name!r})"
        if in_region[i]:
            if tensor.HasField("contents"):
                raise ProtocolError(f"{where}: has both contents and shared_memory_region")
        elif raw:
            k, buffer = next(buffers)
            if tensor.HasField("contents"):
                raise ProtocolError(f"{where}: has both contents and raw_input_contents[{k}]")
            entry["parameters"]["binary_data_size"] = len(buffer)
        else:
            entry["data"] = _typed_values(tensor, where)
            typed = True
        entries.append(entry)
    outputs = [
        {"name": o.name, "parameters": parameters_of(o.parameters)} for o in message.outputs
    ]
    decoded = decode_entries(
        message.id or None, parameters_of(message.parameters), entries, outputs or None,
        iface, b"".join(raw), 0, raw_field="raw_input_contents", regions=regions,
    )
    answer_raw = not typed or any(
        o.info.datatype not in TYPED_FIELDS for o in decoded.outputs
    )
    for wanted in decoded.outputs:  # what response_bytes estimates the response by
        wanted.binary = True
    return decoded, answer_raw


def _typed_values(tensor: Any, where: str) -> np.ndarray:
    """An input's typed contents as a numpy array of its field's type."""
    if not tensor.HasField("contents"):
        raise ProtocolError(f"{where}: no contents and no raw_input_contents")
    contents = tensor.contents
    field = TYPED_FIELDS.get(tensor.datatype)
    if field is None and tensor.datatype in dt.TORCH_DTYPES:
        raise ProtocolError(
            f"{where}.contents: {tensor.datatype} has no typed contents field; send it in "
            f"raw_input_contents"
        )
    for other in _ALL_FIELDS:
        if other != field and len(getattr(contents, other)):
            expected = f"{field}" if field else "none (the datatype is checked next)"
            raise ProtocolError(
                f"{where}.contents.{other}: values of the wrong field for datatype "
                f"{tensor.datatype!r}; expected {expected}"
            )
    if field is None:  # an unknown datatype: the shared check names it
        return np.empty(0, np.float32)
    return np.asarray(getattr(contents, field), dtype=FIELD_DTYPES[field])


def encode_infer_response(
    model: str, version: str, request: InferRequest, outputs: list[Any], raw: bool
) -> Any:
    """The ModelInferResponse of a request's requested outputs: raw or typed (see the
    module docstring)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request.id or "")
    for wanted in request.outputs:
        if wanted.region is not None:  # written into its region: no contents, as Triton's
            entry = write_to_region(wanted, outputs[wanted.info.position])
            response.outputs.add(
                name=entry["name"], datatype=entry["datatype"], shape=entry["shape"]
            )
            if raw:  # a buffer per output, in order: an empty one
                response.raw_output_contents.append(b"")
            continue
        entry, blob, tensor = encode_output(
            wanted.info.name, outputs[wanted.info.position], binary=raw
        )
        out = response.outputs.add(
            name=entry["name"], datatype=entry["datatype"], shape=entry["shape"]
        )
        if raw:
            assert blob is not None
            response.raw_output_contents.append(blob)
        else:
            assert tensor is not None
            getattr(out.contents, TYPED_FIELDS[entry["datatype"]]).extend(_values(tensor))
    return response


def response_bytes(request: InferRequest, outputs: list[Any], raw: bool) -> int:
    """An upper bound of the ModelInferResponse's encoded size: codec.response_bytes's for a
    raw one; for a typed one, each value at its worst case (`TYPED_VALUE_BYTES`)."""
    if raw:
        return codec.response_bytes(request, outputs)
    total = 128
    for wanted in request.outputs:
        value = outputs[wanted.info.position]
        if isinstance(value, torch.Tensor):
            numel, datatype = value.numel(), dt.DATATYPES.get(value.dtype, "")
        else:
            numel, datatype = 1, dt.SCALAR_DATATYPES.get(type(value), "")
        per = TYPED_VALUE_BYTES.get(datatype, 10)  # 10: the longest varint
        if wanted.region is not None:  # written into shared memory, not the answer
            per = 0
        total += codec.ENTRY_BYTES + len(wanted.info.name) + numel * per
    return total


def _values(tensor: torch.Tensor) -> list[Any]:
    return tensor.reshape(-1).tolist()  # type: ignore[no-any-return]
