"""The inference request and response bodies: JSON tensors and the binary tensor data extension.

A request body is JSON, or - with Triton's binary extension - a JSON header of
`Inference-Header-Content-Length` bytes followed by the raw little-endian data of the inputs
whose `parameters.binary_data_size` is set, in the order the header lists them.

Decoding runs in two passes so that a bad request never allocates: the first checks every
field (names, datatypes, every dimension against the signature, data lengths, the binary
layout) using only the numbers in the header; the second makes the tensors. A shape of
10^12 elements is refused because it does not match the bytes that came, not after trying to
allocate it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch

from asyncgraph.serve import datatypes as dt
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.interface import ModelInterface, TensorInfo, describe

HEADER = "Inference-Header-Content-Length"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"


@dataclass(slots=True)
class RequestedOutput:
    info: TensorInfo
    binary: bool


@dataclass(slots=True)
class InferRequest:
    """A decoded request: the flat inputs in signature order and the outputs to send back."""

    id: str | None
    inputs: list[Any]
    outputs: list[RequestedOutput]
    parameters: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None


@dataclass(slots=True)
class _Planned:
    """An input that passed the first pass: where its data is and what it becomes."""

    info: TensorInfo
    shape: tuple[int, ...]
    data: list[Any] | None = None
    offset: int = 0
    size: int = 0


# -- requests -------------------------------------------------------------------------------


def decode_request(
    body: bytes, header_length: str | None, iface: ModelInterface
) -> InferRequest:
    """Check and decode an inference request body (see the module docstring)."""
    header, binary_start = _split(body, header_length)
    try:
        doc = json.loads(header)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"request body: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"request body: expected a JSON object, got {_kind(doc)}")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f"id: expected a string, got {_kind(request_id)}")
    parameters = _object(doc.get("parameters", {}), "parameters")
    planned = _plan_inputs(doc.get("inputs"), iface, len(body) - binary_start, binary_start)
    outputs = _requested_outputs(doc.get("outputs"), parameters, iface)
    timeout_s = request_timeout_s(parameters)
    flat: list[Any] = [None] * iface.count
    for position, value in iface.fixed.items():
        flat[position] = value
    for plan in planned:
        flat[plan.info.position] = _materialize(plan, body)
    return InferRequest(request_id, flat, outputs, parameters, timeout_s)


def request_timeout_s(parameters: Mapping[str, Any]) -> float | None:
    """The request's own timeout in seconds, from Triton's `parameters.timeout` (an integer
    number of microseconds, what `tritonclient`'s `infer(timeout=...)` sends); 0 or absent:
    none of its own."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if not _is_int(timeout) or timeout < 0:
        raise ProtocolError(
            f"parameters.timeout: expected a non-negative integer (microseconds), "
            f"got {timeout!r}"
        )
    return timeout / 1e6 if timeout else None


def _split(body: bytes, header_length: str | None) -> tuple[bytes, int]:
    """The JSON header and where the binary data starts (len(body) when there is none)."""
    if header_length is None:
        return body, len(body)
    try:
        n = int(header_length)
    except ValueError:
        raise ProtocolError(
            f"{HEADER} header: expected an integer, got {header_length!r}"
        ) from None
    if not 0 < n <= len(body):
        raise ProtocolError(
            f"{HEADER} header: expected a length in [1, {len(body)}] (the body's size), got {n}"
        )
    return body[:n], n


def _plan_inputs(
    entries: Any, iface: ModelInterface, binary_size: int, binary_start: int
) -> list[_Planned]:
    """Pass one: check every input entry against the interface; allocate nothing."""
    if not isinstance(entries, list):
        raise ProtocolError(f"inputs: expected a list of tensors, got {_kind(entries)}")
    planned: list[_Planned] = []
    seen: dict[str, str] = {}
    bound: dict[sympy.Symbol, tuple[int, str]] = {}
    offset = binary_start
    for i, entry in enumerate(entries):
        where = f"inputs[{i}]"
        entry = _object(entry, where)
        name = entry.get("name")
        if not isinstance(name, str):
            raise ProtocolError(f"{where}.name: expected a string, got {_kind(name)}")
        where = f"inputs[{i}] ({name!r})"
        info = iface.inputs_by_name.get(name)
        if info is None:
            expected = ", ".join(repr(n) for n in iface.inputs_by_name) or "none"
            raise ProtocolError(
                f"inputs[{i}].name: unknown input {name!r}; model {iface.model!r} expects "
                f"{expected}"
            )
        if name in seen:
            raise ProtocolError(f"inputs[{i}].name: input {name!r} given twice (also {seen[name]})")
        seen[name] = f"inputs[{i}]"
        datatype = entry.get("datatype")
        if datatype != info.datatype:
            raise ProtocolError(
                f"{where}.datatype: expected {info.datatype!r}, got {datatype!r}"
            )
        shape = _check_shape(entry.get("shape"), info, where, iface, bound)
        numel = math.prod(shape)
        params = _object(entry.get("parameters", {}), f"{where}.parameters")
        if "shared_memory_region" in params:
            raise ProtocolError(f"{where}.parameters.shared_memory_region: not supported")
        size = params.get("binary_data_size")
        plan = _Planned(info, shape)
        if size is not None:
            if "data" in entry:
                raise ProtocolError(f"{where}: has both data and parameters.binary_data_size")
            if not _is_int(size) or size < 0:
                raise ProtocolError(
                    f"{where}.parameters.binary_data_size: expected a non-negative integer, "
                    f"got {size!r}"
                )
            if binary_size == 0:
                raise ProtocolError(
                    f"{where}.parameters.binary_data_size: set, but the request has no binary "
                    f"data (no {HEADER} header)"
                )
            want = numel * dt.itemsize(info.datatype)
            if size != want:
                raise ProtocolError(
                    f"{where}.parameters.binary_data_size: expected {want} bytes for "
                    f"{info.datatype} {list(shape)}, got {size}"
                )
            plan.offset, plan.size = offset, size
            offset += size
        else:
            if "data" not in entry:
                raise ProtocolError(f"{where}.data: missing (and no binary_data_size)")
            plan.data = _check_data(entry["data"], info, shape, numel, where)
        planned.append(plan)
    missing = [i for i in iface.inputs if i.name not in seen]
    if missing:
        listed = ", ".join(f"{i.name!r} ({describe(i)})" for i in missing)
        raise ProtocolError(f"inputs: missing input(s) {listed}")
    used = offset - binary_start
    if used != binary_size:
        raise ProtocolError(
            f"binary data: the inputs declare {used} bytes, the body carries {binary_size} "
            f"after the {HEADER} header"
        )
    return planned


def _check_shape(
    shape: Any,
    info: TensorInfo,
    where: str,
    iface: ModelInterface,
    bound: dict[sympy.Symbol, tuple[int, str]],
) -> tuple[int, ...]:
    """Check a requested shape against the signature: rank, static sizes, symbol ranges."""
    if not isinstance(shape, list):
        raise ProtocolError(f"{where}.shape: expected a list of integers, got {_kind(shape)}")
    for axis, size in enumerate(shape):
        if not _is_int(size) or size < 0:
            raise ProtocolError(
                f"{where}.shape[{axis}]: expected a non-negative integer, got {size!r}"
            )
    if info.scalar is not None:
        if shape not in ([], [1]):
            raise ProtocolError(f"{where}.shape: expected [] or [1] for a scalar, got {shape}")
        return tuple(shape)
    if len(shape) != len(info.dims):
        raise ProtocolError(
            f"{where}.shape: expected {len(info.dims)} dimension(s) {info.shape}, "
            f"got {len(shape)} {shape}"
        )
    for axis, (want, got) in enumerate(zip(info.dims, shape, strict=True)):
        at = f"{where}.shape[{axis}]"
        if isinstance(want, int):
            if want != got:
                raise ProtocolError(f"{at}: expected {want}, got {got}")
        elif isinstance(want, sympy.Symbol):
            if want in bound and bound[want][0] != got:
                value, first = bound[want]
                raise ProtocolError(
                    f"{at}: expected {value} (the same dimension as {first}), got {got}"
                )
            lo, hi = iface.ranges.get(want, (0, math.inf))
            if not lo <= got <= hi:
                upper = "inf" if hi == math.inf else str(int(hi))
                raise ProtocolError(f"{at}: expected a size in [{lo}, {upper}], got {got}")
            bound.setdefault(want, (got, at))
        # a derived size (2*s0) is checked by the executor's validator, before any kernel
    return tuple(shape)


def _check_data(data: Any, info: TensorInfo, shape: tuple[int, ...], numel: int, where: str
                ) -> list[Any]:
    """Flatten JSON data (flat or nested, row-major), check its length and element types."""
    flat = _flatten(data, numel, where)
    if len(flat) != numel:
        raise ProtocolError(
            f"{where}.data: expected {numel} element(s) for shape {list(shape)}, got {len(flat)}"
        )
    datatype = info.datatype
    if datatype == "BOOL":
        for k, v in enumerate(flat):
            if type(v) is not bool:
                raise ProtocolError(f"{where}.data[{k}]: expected true or false, got {v!r}")
    elif datatype in dt.INTEGER_DATATYPES:
        for k, v in enumerate(flat):
            if type(v) is not int:
                raise ProtocolError(f"{where}.data[{k}]: expected an integer, got {v!r}")
        if flat:
            lo, hi = dt.integer_range(datatype)
            for k, v in enumerate(flat):
                if not lo <= v <= hi:
                    raise ProtocolError(
                        f"{where}.data[{k}]: {v} is out of range for {datatype} [{lo}, {hi}]"
                    )
    else:
        for k, v in enumerate(flat):
            if type(v) is not float and type(v) is not int:
                raise ProtocolError(f"{where}.data[{k}]: expected a number, got {v!r}")
    return flat


def _flatten(data: Any, limit: int, where: str) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    if all(not isinstance(v, list) for v in data):
        return data
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
            if len(flat) > limit:
                raise ProtocolError(f"{where}.data: more than the {limit} element(s) of the shape")
        else:
            stack.pop()
    return flat


def _materialize(plan: _Planned, body: bytes) -> Any:
    """Pass two: make the tensor (or Python scalar) of a checked input."""
    info = plan.info
    dtype = dt.TORCH_DTYPES[info.datatype]
    if plan.data is not None:
        tensor = torch.tensor(plan.data, dtype=dtype).reshape(plan.shape)
    else:
        raw = torch.empty(plan.size, dtype=torch.uint8)
        if plan.size:
            raw.numpy()[:] = np.frombuffer(body, np.uint8, count=plan.size, offset=plan.offset)
        if info.datatype == "BOOL" and plan.size and bool((raw > 1).any()):
            raise ProtocolError(f"input {info.name!r}: BOOL binary data must be bytes 0 or 1")
        tensor = raw.view(dtype).reshape(plan.shape)
    if info.scalar is not None:
        return info.scalar(tensor.reshape(()).item())
    if info.device.type != "cpu":
        tensor = tensor.to(info.device)
    return tensor


def _requested_outputs(
    entries: Any, parameters: Mapping[str, Any], iface: ModelInterface
) -> list[RequestedOutput]:
    default = parameters.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise ProtocolError(
            f"parameters.binary_data_output: expected true or false, got {default!r}"
        )
    if entries is None:
        return [RequestedOutput(o, default) for o in iface.outputs]
    if not isinstance(entries, list):
        raise ProtocolError(f"outputs: expected a list, got {_kind(entries)}")
    requested: list[RequestedOutput] = []
    for i, entry in enumerate(entries):
        entry = _object(entry, f"outputs[{i}]")
        name = entry.get("name")
        info = iface.outputs_by_name.get(name) if isinstance(name, str) else None
        if info is None:
            expected = ", ".join(repr(n) for n in iface.outputs_by_name)
            raise ProtocolError(
                f"outputs[{i}].name: unknown output {name!r}; model {iface.model!r} has "
                f"{expected}"
            )
        params = _object(entry.get("parameters", {}), f"outputs[{i}].parameters")
        for unsupported in ("classification", "shared_memory_region"):
            if unsupported in params:
                raise ProtocolError(f"outputs[{i}].parameters.{unsupported}: not supported")
        binary = params.get("binary_data", default)
        if not isinstance(binary, bool):
            raise ProtocolError(
                f"outputs[{i}].parameters.binary_data: expected true or false, got {binary!r}"
            )
        requested.append(RequestedOutput(info, binary))
    return requested


# -- responses ------------------------------------------------------------------------------


def encode_response(
    model: str,
    request: InferRequest,
    outputs: list[Any],
    version: str = "1",
) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers; binary outputs follow the JSON header."""
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for wanted in request.outputs:
        value = outputs[wanted.info.position]
        entry, blob = _encode_output(wanted.info.name, value, wanted.binary)
        tensors.append(entry)
        if blob is not None:
            blobs.append(blob)
    doc: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.id is not None:
        doc["id"] = request.id
    doc["outputs"] = tensors
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return header, {"content-type": JSON_CONTENT_TYPE}
    headers = {"content-type": BINARY_CONTENT_TYPE, HEADER: str(len(header))}
    return b"".join([header, *blobs]), headers


def json_request_body(inputs: Mapping[str, Any]) -> bytes:
    """A JSON inference request body carrying these named values (tensors or scalars), as a
    client sends it: what the server's start-up calibration decodes (calibration.py)."""
    entries = [_encode_output(name, value, binary=False)[0] for name, value in inputs.items()]
    return json.dumps({"inputs": entries}, separators=(",", ":")).encode()


def _encode_output(name: str, value: Any, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        datatype = dt.datatype_of(tensor.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(tensor.shape)}
    elif isinstance(value, (bool, int, float)):
        datatype = dt.SCALAR_DATATYPES[type(value)]
        tensor = torch.tensor(value, dtype=dt.TORCH_DTYPES[datatype])
        entry = {"name": name, "datatype": datatype, "shape": []}
    else:
        raise TypeError(f"output {name!r}: a {type(value).__name__} cannot be sent as a tensor")
    if binary:
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        blob = raw.numpy().tobytes()
        entry["parameters"] = {"binary_data_size": len(blob)}
        return entry, blob
    entry["data"] = tensor.reshape(-1).tolist()
    return entry, None


# -- helpers --------------------------------------------------------------------------------


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {_kind(value)}")
    return value


def _is_int(value: Any) -> bool:
    return type(value) is int


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), f"a {type(value).__name__}"
    )
