"""The gRPC request decoder under hostile messages.

Whatever a client puts in a ModelInferRequest (any names, datatypes, shapes, typed contents of
any field, raw buffers of any length and count, parameters of any kind), `decode_infer_request`
either gives inputs of exactly the declared shape and dtype, or refuses with a 4xx
ProtocolError whose message stays short. Bytes that are not a message fail in protobuf's parser
(grpc answers those itself, before the decoder runs); bytes that parse are decoded as above.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import sympy
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncgraph.serve import ModelInterface, ProtocolError
from asyncgraph.serve import grpc_protocol as pb
from asyncgraph.serve.datatypes import TORCH_DTYPES
from asyncgraph.serve.grpc_codec import decode_infer_request
from tests.support.serving import identity_graph
from tests.support.strategies import float32s

_S0 = sympy.Symbol("s0", positive=True, integer=True)
_SERVED = ("FP32", "INT8", "BOOL", "UINT64", "BF16", "INT64", "FP16")
_IFACES = {
    d: ModelInterface("m", identity_graph(TORCH_DTYPES[d], (_S0, 3))) for d in _SERVED
}
_INT64 = st.integers(-(2**63), 2**63 - 1)

_dims = st.one_of(st.integers(-2, 6), st.sampled_from([2**31, 10**12, 2**63 - 1]), _INT64)
_contents = st.one_of(
    st.fixed_dictionaries({"fp32_contents": st.lists(float32s, max_size=24)}),
    st.fixed_dictionaries({"fp64_contents": st.lists(st.floats(), max_size=12)}),
    st.fixed_dictionaries({"int_contents": st.lists(st.integers(-(2**31), 2**31 - 1),
                                                    max_size=24)}),
    st.fixed_dictionaries({"int64_contents": st.lists(_INT64, max_size=12)}),
    st.fixed_dictionaries({"uint_contents": st.lists(st.integers(0, 2**32 - 1), max_size=12)}),
    st.fixed_dictionaries({"uint64_contents": st.lists(st.integers(0, 2**64 - 1),
                                                       max_size=12)}),
    st.fixed_dictionaries({"bool_contents": st.lists(st.booleans(), max_size=12)}),
    st.fixed_dictionaries({"bytes_contents": st.lists(st.binary(max_size=8), max_size=3)}),
    st.fixed_dictionaries({}, optional={"fp32_contents": st.lists(float32s,
                                                                  max_size=6),
                                        "int_contents": st.lists(st.integers(0, 9),
                                                                 max_size=6)}),
)
_parameter = st.one_of(
    st.fixed_dictionaries({"bool_param": st.booleans()}),
    st.fixed_dictionaries({"int64_param": _INT64}),
    st.fixed_dictionaries({"string_param": st.text(max_size=8)}),
    st.fixed_dictionaries({"double_param": st.floats()}),
    st.fixed_dictionaries({"uint64_param": st.integers(0, 2**64 - 1)}),
    st.just({}),  # no choice set
)
_parameters = st.dictionaries(
    st.one_of(st.sampled_from(["timeout", "binary_data_size", "binary_data_output",
                               "priority", "classification"]), st.text(max_size=6)),
    _parameter, max_size=3,
)
_inputs = st.lists(
    st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(["x", "y", ""]), st.text(max_size=6)),
         "datatype": st.one_of(st.sampled_from([*TORCH_DTYPES, "BYTES", "fp32", ""]),
                               st.text(max_size=6)),
         "shape": st.lists(_dims, max_size=4)},
        optional={"contents": _contents, "parameters": _parameters},
    ),
    max_size=3,
)
_requests = st.fixed_dictionaries(
    {"inputs": _inputs},
    optional={
        "id": st.text(max_size=8),
        "parameters": _parameters,
        "outputs": st.lists(st.fixed_dictionaries(
            {"name": st.one_of(st.sampled_from(["output_0", "z", ""]), st.text(max_size=4))},
            optional={"parameters": _parameters}), max_size=3),
        "raw_input_contents": st.lists(st.binary(max_size=48), max_size=3),
    },
)


_FIELD_VALUES = {  # a typed field's values that fit its type (and the served datatypes)
    "fp32_contents": float32s, "int_contents": st.integers(-128, 127),
    "int64_contents": _INT64, "uint64_contents": st.integers(0, 2**64 - 1),
    "bool_contents": st.booleans(),
}
_TYPED = {"FP32": "fp32_contents", "INT8": "int_contents", "INT64": "int64_contents",
          "UINT64": "uint64_contents", "BOOL": "bool_contents"}
_MUTATIONS = ("none", "rows", "values", "shape", "datatype", "name", "raw count", "both",
              "parameters")


@st.composite
def _near_valid(draw: Any, datatype: str) -> dict[str, Any]:
    """A request the model accepts, then at most one thing wrong with it: the positive
    half of the fuzz, and refusals one step from acceptance."""
    rows = draw(st.integers(1, 4))
    shape = [rows, 3]
    count = rows * 3
    mutation = draw(st.sampled_from(_MUTATIONS))
    if mutation == "rows":
        count = draw(st.integers(0, 20).filter(lambda n: n != rows * 3))
    tensor: dict[str, Any] = {"name": "x", "datatype": datatype, "shape": shape}
    request: dict[str, Any] = {"inputs": [tensor]}
    field = _TYPED.get(datatype)
    if field is None or draw(st.booleans()):  # raw: FP16 and BF16 have no typed field
        size = TORCH_DTYPES[datatype].itemsize
        request["raw_input_contents"] = [draw(st.binary(min_size=count * size,
                                                        max_size=count * size))]
    else:
        tensor["contents"] = {field: draw(st.lists(_FIELD_VALUES[field], min_size=count,
                                                   max_size=count))}
    if mutation == "values" and "contents" in tensor:
        other = draw(st.sampled_from(sorted(set(_FIELD_VALUES) - {field})))
        tensor["contents"] = {other: draw(st.lists(_FIELD_VALUES[other], min_size=1,
                                                   max_size=count))}
    elif mutation == "shape":
        tensor["shape"] = draw(st.lists(_dims, max_size=4))
    elif mutation == "datatype":
        tensor["datatype"] = draw(st.sampled_from([*TORCH_DTYPES, "BYTES", "fp32", ""]))
    elif mutation == "name":
        tensor["name"] = draw(st.text(max_size=4))
    elif mutation == "raw count":
        request["raw_input_contents"] = draw(st.lists(st.binary(max_size=48), max_size=3))
    elif mutation == "both":
        tensor["contents"] = {"fp32_contents": [1.0]}
        request.setdefault("raw_input_contents", [b"\0" * count * 4])
    elif mutation == "parameters":
        request["parameters"] = draw(_parameters)
        tensor["parameters"] = draw(_parameters)
    return request


def _message(request: dict[str, Any]) -> Any:
    message = pb.ModelInferRequest(model_name="m")
    for key, value in request.items():
        if key == "inputs":
            for tensor in value:
                entry = message.inputs.add(
                    name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
                if "contents" in tensor:
                    entry.contents.SetInParent()
                    for field, values in tensor["contents"].items():
                        getattr(entry.contents, field).extend(values)
                _set_parameters(entry.parameters, tensor.get("parameters", {}))
        elif key == "outputs":
            for output in value:
                entry = message.outputs.add(name=output["name"])
                _set_parameters(entry.parameters, output.get("parameters", {}))
        elif key == "parameters":
            _set_parameters(message.parameters, value)
        elif key == "raw_input_contents":
            message.raw_input_contents.extend(value)
        else:
            setattr(message, key, value)
    return message


def _set_parameters(target: Any, parameters: dict[str, dict[str, Any]]) -> None:
    for name, choice in parameters.items():
        target[name].SetInParent()
        for field, value in choice.items():
            setattr(target[name], field, value)


def _decodes_or_refuses(message: Any, datatype: str) -> None:
    try:
        decoded, _ = decode_infer_request(message, _IFACES[datatype])
    except ProtocolError as exc:
        assert 400 <= exc.status < 500, exc
        assert len(exc.message) < 2000, exc.message[:200]
        event("refused")
        return
    event("decoded")
    (x,) = decoded.inputs
    assert isinstance(x, torch.Tensor) and x.dtype == TORCH_DTYPES[datatype]
    # dim 0 is s0, in the range the program declares (none here: [0, inf], so damage that
    # turns shape [1, 3] into [0, 3] with no contents is a valid empty request)
    low, high = _IFACES[datatype].ranges.get(_S0, (0, math.inf))
    assert x.dim() == 2 and x.shape[1] == 3 and low <= x.shape[0] <= high, x.shape


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_requests, datatype=st.sampled_from(_SERVED))
def test_fuzz_any_message_decodes_to_the_declared_shape_or_is_a_4xx(
    request: dict[str, Any], datatype: str
) -> None:
    _decodes_or_refuses(_message(request), datatype)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), datatype=st.sampled_from(_SERVED))
def test_fuzz_a_message_one_step_from_valid_decodes_or_is_a_4xx(data: Any, datatype: str) -> None:
    _decodes_or_refuses(_message(data.draw(_near_valid(datatype))), datatype)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), datatype=st.sampled_from(_SERVED),
       damage=st.tuples(st.integers(0, 120), st.binary(min_size=1, max_size=8)))
def test_fuzz_damaged_wire_bytes_fail_to_parse_or_decode_as_above(
    data: Any, datatype: str, damage: tuple[int, bytes]
) -> None:
    request = data.draw(st.one_of(_near_valid(datatype), _requests))
    wire = _message(request).SerializeToString()
    at, junk = damage
    wire = wire[:at] + junk + wire[at + len(junk):]
    try:
        message = pb.ModelInferRequest.FromString(wire)
    except DecodeError:
        return  # grpc's deserializer fails the call before asyncgraph sees it
    _decodes_or_refuses(message, datatype)


def test_a_well_formed_request_of_each_kind_decodes() -> None:
    """The fuzz's positive half exists: typed and raw requests of the declared shape decode."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    typed = _message({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3],
                                  "contents": {"fp32_contents": x.ravel().tolist()}}]})
    raw = _message({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3]}],
                    "raw_input_contents": [x.tobytes()]})
    for message in (typed, raw):
        decoded, _ = decode_infer_request(message, _IFACES["FP32"])
        torch.testing.assert_close(decoded.inputs[0], torch.from_numpy(x))


def test_a_huge_declared_shape_is_refused_before_allocating() -> None:
    message = _message({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2**62, 3]}],
                        "raw_input_contents": [b"\0" * 24]})
    try:
        decode_infer_request(message, _IFACES["FP32"])
    except ProtocolError as exc:
        assert exc.status == 400 and "x" in exc.message, exc.message
    else:
        raise AssertionError("a 2**62-row input was accepted")


def test_an_empty_batch_in_the_declared_range_decodes_to_an_empty_tensor() -> None:
    # found by the damaged-bytes fuzz: shape [1, 3] damaged to [0, 3], with no contents
    message = pb.ModelInferRequest(model_name="m")
    entry = message.inputs.add(name="x", datatype="FP32")
    entry.shape.extend([0, 3])
    entry.contents.SetInParent()
    decoded, _ = decode_infer_request(message, _IFACES["FP32"])
    (x,) = decoded.inputs
    assert x.shape == (0, 3) and x.dtype == torch.float32
