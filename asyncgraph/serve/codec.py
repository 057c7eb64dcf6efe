"""The inference request and response bodies: JSON tensors and the binary tensor data extension.

A request body is JSON, or - with Triton's binary extension - a JSON header of
`Inference-Header-Content-Length` bytes followed by the raw little-endian data of the inputs
whose `parameters.binary_data_size` is set, in the order the header lists them.

Decoding runs in two passes so that a bad request never allocates: the first checks every
field (names, datatypes, every dimension against the signature, data lengths, the binary
layout) using only the numbers in the header; the second makes the tensors. A shape of
10^12 elements is refused because it does not match the bytes that came, not after trying to
allocate it.

JSON is parsed so that no body the limits admit holds the event loop for long (issue 39):
`json.loads` holds the GIL for its whole run even on a thread (64 MB of JSON floats: 1.2 s;
64 MB of `[],`: 12 s with 2 GB of lists). So the numeric `"data"` arrays of the inputs are cut
out of the document first (bytes.find, C speed) and parsed apart, in pieces of
`PIECE_BYTES` (each piece a short `json.loads`, so a decode on a thread lets the loop run
between pieces, and only one piece's Python list lives at a time); the rest, the document's
skeleton, and any array that is not a plain or evenly nested array of values, is parsed by
`json.loads` whole and may be at most `max_json_bytes` (413 beyond; `--max-json-bytes`).
The result is the same as `json.loads` of the whole body: a piece that fails to parse falls
back to the exact parse (within `max_json_bytes`).

An input may instead name a system shared memory region (parameters `shared_memory_region`,
`shared_memory_byte_size`, `shared_memory_offset`; shared_memory.py): its bytes are copied
from there, checked as binary data is; an output may be asked into a region, where the
encode writes it. The transports pass the request's `Lease` on the server's regions.

Every malformed value gets a ProtocolError (400, or 413 for a size limit), never another
exception: values are shown shortened (`_show`), sizes are bounded (`MAX_DIM`), and the
request-level parameters are range-checked.
"""

from __future__ import annotations

import gc
import json
import math
import re
import secrets
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch

from asyncgraph.serve import datatypes as dt
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.interface import ModelInterface, TensorInfo, describe
from asyncgraph.serve.shared_memory import Lease, RegionSlice

HEADER = "Inference-Header-Content-Length"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"

#: JSON parsed by `json.loads` as a whole, per request: the document without its numeric data
#: arrays (its skeleton), and any data array that is not a plain or evenly nested array. 1 MB
#: of the worst JSON (`[],` repeated) held a server's loop ~0.1 s (with the collector paused,
#: `_gc_paused`; 0.9 s without) on 2 loaded cores; real skeletons (names, shapes, parameters)
#: are a few hundred bytes.
DEFAULT_MAX_JSON_BYTES = 1 << 20

#: A data array is parsed in pieces of about this many bytes (~5 ms of `json.loads` each).
PIECE_BYTES = 256 << 10

#: Data arrays shorter than this stay in the skeleton (one parse is cheaper than cutting).
CUT_BYTES = 4096

#: The largest dimension or element count a request may name (torch's int64 sizes).
MAX_DIM = (1 << 63) - 1

#: The largest `parameters.timeout` (microseconds): Triton's uint64.
MAX_TIMEOUT_US = (1 << 64) - 1

#: How many characters of a client's value an error message quotes.
SHOW_CHARS = 80

#: The most dimensions a tensor has (PyTorch's limit).
MAX_RANK = 64

#: The numpy dtype JSON values of a non-float datatype are gathered in.
NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64,
}

_DATA_KEY = b'"data"'
_BRACKETS_TO_SPACES = bytes.maketrans(b"[]", b"  ")
_JSON_SPACE = b" \t\n\r"
_NUMBER_CHARS = b"0123456789.eE+-," + _JSON_SPACE
_INTEGER_CHARS = b"0123456789-," + _JSON_SPACE
_BOOL_CHARS = b"truefals," + _JSON_SPACE


@dataclass(slots=True)
class RequestedOutput:
    info: TensorInfo
    binary: bool
    #: where the output is written instead of the answer (system shared memory)
    region: RegionSlice | None = None


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
    data: np.ndarray | None = None
    offset: int = 0
    size: int = 0
    region: RegionSlice | None = None  # its bytes are in a shared memory region


# -- requests -------------------------------------------------------------------------------


def decode_request(
    body: bytes,
    header_length: str | None,
    iface: ModelInterface,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    regions: Lease | None = None,
) -> InferRequest:
    """Check and decode an inference request body (see the module docstring); `regions`:
    the request's lease on the server's shared memory regions (None: none may be named)."""
    header, binary_start = _split(body, header_length)
    doc = parse_document(header, max_json_bytes)
    if not isinstance(doc, dict):
        raise ProtocolError(f"request body: expected a JSON object, got {_kind(doc)}")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f"id: expected a string, got {_kind(request_id)}")
    parameters = _object(doc.get("parameters", {}), "parameters")
    return decode_entries(
        request_id, parameters, doc.get("inputs"), doc.get("outputs"), iface, body,
        binary_start, max_json_bytes, regions=regions,
    )


#: Where an input entry says how many bytes of the binary data are its own.
BINARY_SIZE_FIELD = "parameters.binary_data_size"


def decode_entries(
    request_id: str | None,
    parameters: dict[str, Any],
    inputs: Any,
    outputs: Any,
    iface: ModelInterface,
    body: bytes,
    binary_start: int,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    *,
    raw_field: str = BINARY_SIZE_FIELD,
    regions: Lease | None = None,
) -> InferRequest:
    """Check and decode a request already parsed into the protocol's entries (the JSON
    document's `inputs` and `outputs`, or a gRPC request's, grpc_codec.py): every transport
    shares this validation. An input entry's values are its `data` (JSON values, or a numpy
    array of a gRPC request's typed contents), or the next `parameters.binary_data_size`
    bytes of `body` from `binary_start` on, or the bytes of the shared memory region its
    parameters name (`regions`, shared_memory.py); `raw_field` names that size in error
    messages."""
    planned = _plan_inputs(
        inputs, iface, len(body) - binary_start, binary_start, max_json_bytes,
        raw_field=raw_field, regions=regions,
    )
    requested = _requested_outputs(outputs, parameters, iface, regions)
    timeout_s = request_timeout_s(parameters)
    flat: list[Any] = [None] * iface.count
    for position, value in iface.fixed.items():
        flat[position] = value
    for plan in planned:
        flat[plan.info.position] = _materialize(plan, body)
    return InferRequest(request_id, flat, requested, parameters, timeout_s)


def request_timeout_s(parameters: Mapping[str, Any]) -> float | None:
    """The request's own timeout in seconds, from Triton's `parameters.timeout` (an integer
    number of microseconds, what `tritonclient`'s `infer(timeout=...)` sends; Triton's
    uint64); 0 or absent: none of its own."""
    timeout = parameters.get("timeout")
    if timeout is None:
        return None
    if not _is_int(timeout) or not 0 <= timeout <= MAX_TIMEOUT_US:
        raise ProtocolError(
            f"parameters.timeout: expected an integer number of microseconds in "
            f"[0, {MAX_TIMEOUT_US}], got {_show(timeout)}"
        )
    return timeout / 1e6 if timeout else None


# -- JSON -----------------------------------------------------------------------------------


class RawArray:
    """A JSON data array cut out of the document, parsed once its datatype is known
    (`_check_data`): `source[start:end]` is the array's JSON text, brackets included (not
    copied: a 64 MB copy holds the GIL too)."""

    __slots__ = ("end", "source", "start")

    def __init__(self, source: bytes, start: int, end: int) -> None:
        self.source, self.start, self.end = source, start, end

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def text(self) -> bytes:
        return self.source[self.start:self.end]

    def count(self) -> int:
        """The number of values, if the array is well formed: commas + 1, or 0 when empty."""
        commas = self.source.count(b",", self.start, self.end)
        if commas:
            return commas + 1
        return 0 if not self.text.translate(None, b"[]" + _JSON_SPACE) else 1


def parse_document(text: bytes, max_json_bytes: int = DEFAULT_MAX_JSON_BYTES) -> Any:
    """`json.loads(text)`, with each input's large `"data"` array left as a RawArray (see
    the module docstring); ProtocolError (400, 413 past `max_json_bytes`) for anything else
    than a JSON document within the limits."""
    skeleton, arrays, marker = _cut_data_arrays(text)
    if arrays:
        if len(skeleton) > max_json_bytes:
            raise _json_too_large(len(skeleton), max_json_bytes, "outside its data arrays")
        try:
            with _gc_paused(len(skeleton)):
                doc = json.loads(skeleton)
            _check_depth(doc, "request body")
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            if len(text) > max_json_bytes:  # else parsed whole below, for its exact error
                raise ProtocolError(
                    f"request body: not valid JSON outside its data arrays ("
                    f"{_show(str(exc), 200)})"
                ) from None
            doc = None
        if doc is not None and _attach(doc, arrays, marker):
            return doc
    if len(text) > max_json_bytes:
        raise _json_too_large(len(text), max_json_bytes, "that is not plain data arrays")
    return _loads(text, "request body")


#: The deepest JSON nesting a request may have: a tensor of 64 dimensions as nested lists,
#: inside the request's own objects. Checked after parsing too, so the bound does not depend
#: on the interpreter's recursion limit (which libraries raise, and json.loads obeys).
MAX_JSON_DEPTH = 72


def _loads(text: bytes, where: str) -> Any:
    try:
        with _gc_paused(len(text)):
            doc = json.loads(text)
    except RecursionError:
        raise ProtocolError(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"{where}: not valid JSON ({_show(str(exc), 200)})") from None
    _check_depth(doc, where)
    return doc


def _containers(value: Any) -> list[Any]:
    """The lists and objects directly inside `value`. A long list whose ends are not
    containers is a flat data array: it is not scanned (a deep list hidden inside one still
    meets json.loads' own recursion limit)."""
    items = value.values() if isinstance(value, dict) else value
    if isinstance(value, list) and len(value) > 64 and not any(
            isinstance(v, (list, dict)) for v in (value[0], value[-1])):
        return []
    return [v for v in items if isinstance(v, (list, dict))]


def _check_depth(doc: Any, where: str) -> None:
    """ProtocolError when `doc` nests lists and objects deeper than MAX_JSON_DEPTH."""
    level = [doc]
    for _ in range(MAX_JSON_DEPTH):
        level = [c for v in level if isinstance(v, (list, dict)) for c in _containers(v)]
        if not level:
            return
    raise ProtocolError(f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)")


#: JSON texts longer than this are parsed with the cyclic garbage collector paused.
GC_PAUSE_BYTES = 64 << 10

_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextmanager
def _gc_paused(nbytes: int) -> Iterator[None]:
    """Pause the cyclic garbage collector while a text of `nbytes` becomes Python objects.

    `json.loads` of 1 MB of `[],` makes 350,000 lists, and each few hundred set off a
    collection; in a server process (torch imported: a million tracked objects) the full
    ones took 0.55-0.75 s of the 1 MB parse, held under the GIL, against 0.06 s without them.
    The lists are acyclic, so nothing is lost; concurrent decodes (threads) share the pause,
    and a collector the application turned off stays off."""
    global _gc_pausers, _gc_was_enabled
    if nbytes <= GC_PAUSE_BYTES:
        yield
        return
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def _json_too_large(size: int, limit: int, what: str) -> ProtocolError:
    return ProtocolError(
        f"request body: {size} bytes of JSON {what}, over the limit of {limit} bytes "
        f"(--max-json-bytes): send each input's data as a flat (or evenly nested) array of "
        f"values, or as binary tensor data",
        413,
    )


def _cut_data_arrays(text: bytes) -> tuple[bytes, list[RawArray], str]:
    """The document with each large `"data": [...]` array replaced by a marker string, the
    arrays' texts, and the marker's prefix (random per call, so no client can forge it)."""
    arrays: list[RawArray] = []
    parts: list[bytes] = []
    marker = ""  # made for the first array cut
    start = 0
    at = text.find(_DATA_KEY)
    while at >= 0:
        i = at + len(_DATA_KEY)
        n = len(text)
        while i < n and text[i] in b" \t\n\r":
            i += 1
        if i < n and text[i] == 0x3A:  # ':'
            i += 1
            while i < n and text[i] in b" \t\n\r":
                i += 1
            if i < n and text[i] == 0x5B:  # '['
                end = _array_end(text, i)
                if end is None:
                    break
                if end - i >= CUT_BYTES:
                    marker = marker or "\x00asyncgraph-" + secrets.token_hex(8) + ":"
                    parts.append(text[start:i])
                    parts.append(json.dumps(marker + str(len(arrays))).encode())
                    arrays.append(RawArray(text, i, end))
                    start = end
                at = text.find(_DATA_KEY, end)
                continue
        at = text.find(_DATA_KEY, i)
    if not arrays:
        return text, arrays, marker
    parts.append(text[start:])
    return b"".join(parts), arrays, marker


#: A data array is given up on (parsed whole, within --max-json-bytes) past this many rows.
_MAX_ROWS_SCANNED = 1 << 20


def _array_end(text: bytes, start: int) -> int | None:
    """The index after the bracket closing the array opened at `start` (brackets inside
    strings are not told apart: such an array fails to parse in pieces and is parsed whole);
    None if there is none within `_MAX_ROWS_SCANNED` closing brackets."""
    depth = 1
    i = start + 1
    for _ in range(_MAX_ROWS_SCANNED):
        close = text.find(b"]", i)
        if close < 0:
            return None
        depth += text.count(b"[", i, close) - 1
        if depth <= 0:
            return close + 1
        i = close + 1
    return None


def _attach(doc: Any, arrays: list[RawArray], marker: str) -> bool:
    """Put each cut array back where its marker is, as a RawArray: True when every marker
    is an input's `data` (a `"data"` key anywhere else was cut too: then parse it all)."""
    entries = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return False
    found = 0
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        data = entry.get("data")
        if isinstance(data, str) and data.startswith(marker):
            index = data[len(marker):]
            if not index.isdigit() or int(index) >= len(arrays):
                return False
            entry["data"] = arrays[int(index)]
            found += 1
    return found == len(arrays)


def _pieces(raw: RawArray) -> Any:
    """The values of a plain or evenly nested array, in lists of a piece each, row-major;
    ValueError when the text is not such an array."""
    source = raw.source
    n = raw.end - 1  # the closing bracket
    pos = raw.start + 1
    split = False
    while pos < n or split:
        end = source.find(b",", pos + PIECE_BYTES, n) if n - pos > PIECE_BYTES else -1
        piece = source[pos:n if end < 0 else end].translate(_BRACKETS_TO_SPACES)
        values = json.loads(b"[" + piece + b"]")
        if split and not values:
            raise ValueError("an empty value between commas")
        yield piece, values
        if end < 0:
            return
        pos, split = end + 1, True

def _split(body: bytes, header_length: str | None) -> tuple[bytes, int]:
    """The JSON header and where the binary data starts (len(body) when there is none)."""
    if header_length is None:
        return body, len(body)
    try:
        n = int(header_length)
    except ValueError:
        raise ProtocolError(
            f"{HEADER} header: expected an integer, got {_show(header_length)}"
        ) from None
    if not 0 < n <= len(body):
        raise ProtocolError(
            f"{HEADER} header: expected a length in [1, {len(body)}] (the body's size), got {n}"
        )
    return body[:n], n


def _plan_inputs(
    entries: Any,
    iface: ModelInterface,
    binary_size: int,
    binary_start: int,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
    *,
    raw_field: str = BINARY_SIZE_FIELD,
    regions: Lease | None = None,
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
        info = iface.inputs_by_name.get(name)
        if info is None:
            expected = ", ".join(repr(n) for n in iface.inputs_by_name) or "none"
            raise ProtocolError(
                f"inputs[{i}].name: unknown input {_show(name)}; model {iface.model!r} "
                f"expects {expected}"
            )
        where = f"inputs[{i}] ({name!r})"
        if name in seen:
            raise ProtocolError(f"inputs[{i}].name: input {name!r} given twice (also {seen[name]})")
        seen[name] = f"inputs[{i}]"
        datatype = entry.get("datatype")
        if datatype != info.datatype:
            raise ProtocolError(
                f"{where}.datatype: expected {info.datatype!r}, got {_show(datatype)}"
            )
        shape = _check_shape(entry.get("shape"), info, where, iface, bound)
        numel = math.prod(shape)
        if numel > MAX_DIM:
            raise ProtocolError(
                f"{where}.shape: {len(str(numel))}-digit element count of {list(shape)} "
                f"exceeds the largest tensor ({MAX_DIM} elements)"
            )
        params = _object(entry.get("parameters", {}), f"{where}.parameters")
        size = params.get("binary_data_size")
        plan = _Planned(info, shape)
        if "shared_memory_region" in params:
            _plan_region(plan, entry, params, numel, where, regions)
        elif size is not None:
            if "data" in entry:
                raise ProtocolError(f"{where}: has both data and {raw_field}")
            if not _is_int(size) or size < 0:
                raise ProtocolError(
                    f"{where}.{raw_field}: expected a non-negative integer, got {_show(size)}"
                )
            if binary_size == 0 and size:
                raise ProtocolError(
                    f"{where}.{raw_field}: set, but the request has no binary "
                    f"data (no {HEADER} header)"
                )
            want = numel * dt.itemsize(info.datatype)
            if size != want:
                raise ProtocolError(
                    f"{where}.{raw_field}: expected {want} bytes for "
                    f"{info.datatype} {list(shape)}, got {_show(size)}"
                )
            plan.offset, plan.size = offset, size
            offset += size
        else:
            if "data" not in entry:
                raise ProtocolError(f"{where}.data: missing (and no binary_data_size)")
            plan.data = _check_data(entry["data"], info, shape, numel, where, max_json_bytes)
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


def _plan_region(
    plan: _Planned, entry: Mapping[str, Any], params: Mapping[str, Any], numel: int,
    where: str, regions: Lease | None,
) -> None:
    """An input whose bytes are in a shared memory region: its slice, checked (leased)."""
    if regions is None:
        raise ProtocolError(f"{where}.parameters.shared_memory_region: not supported")
    if "data" in entry or "binary_data_size" in params:
        other = "data" if "data" in entry else "parameters.binary_data_size"
        raise ProtocolError(f"{where}: has both parameters.shared_memory_region and {other}")
    want = numel * dt.itemsize(plan.info.datatype)
    plan.region = regions.input(
        params["shared_memory_region"], params.get("shared_memory_offset"),
        params.get("shared_memory_byte_size"), want, where,
    )
    plan.size = want


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
    if len(shape) > MAX_RANK:
        raise ProtocolError(
            f"{where}.shape: {len(shape)} dimensions, more than any tensor has ({MAX_RANK})"
        )
    for axis, size in enumerate(shape):
        if not _is_int(size) or not 0 <= size <= MAX_DIM:
            raise ProtocolError(
                f"{where}.shape[{axis}]: expected an integer in [0, {MAX_DIM}], "
                f"got {_show(size)}"
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


def _check_data(
    data: Any,
    info: TensorInfo,
    shape: tuple[int, ...],
    numel: int,
    where: str,
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES,
) -> np.ndarray:
    """The values of JSON data (flat or nested, row-major), checked for their count and
    types, as a numpy array (float64 for the float datatypes, cast to the datatype later).
    A numpy array (a gRPC request's typed contents, already of their field's type) is
    checked for its count and, for the narrower integer datatypes, its range."""
    if isinstance(data, np.ndarray):
        return _check_array(data, info.datatype, shape, numel, where)
    if isinstance(data, RawArray) and data.count() != numel:
        if len(data) > max_json_bytes:  # else parsed whole below, for the exact count
            raise ProtocolError(
                f"{where}.data: expected {numel} element(s) for shape {list(shape)}, "
                f"got {data.count()} (counted by its commas: an array past --max-json-bytes "
                f"must be flat or evenly nested, with no empty rows)"
            )
        data = _loads(data.text, f"{where}.data")
    if isinstance(data, RawArray):
        try:
            arrays = []
            done = 0
            for piece, values in _pieces(data):
                arrays.append(_values(values, info.datatype, where, done, piece))
                done += len(values)
        except (ValueError, RecursionError):
            # not a plain or evenly nested array (an empty row, a string with a bracket,
            # invalid JSON): parse it whole, within the JSON limit, for its exact error
            if len(data) > max_json_bytes:
                raise ProtocolError(
                    f"{where}.data: not a flat or evenly nested JSON array of values, and "
                    f"{len(data)} bytes, over the limit of {max_json_bytes} bytes for "
                    f"other JSON (--max-json-bytes)", 413,
                ) from None
            data = _loads(data.text, f"{where}.data")
        else:
            if done != numel:
                raise ProtocolError(
                    f"{where}.data: expected {numel} element(s) for shape {list(shape)}, "
                    f"got {done}"
                )
            if not arrays:
                return _values([], info.datatype, where, 0, None)
            return np.concatenate(arrays) if len(arrays) != 1 else arrays[0]
    flat = _flatten(data, numel, where)
    if len(flat) != numel:
        raise ProtocolError(
            f"{where}.data: expected {numel} element(s) for shape {list(shape)}, got {len(flat)}"
        )
    return _values(flat, info.datatype, where, 0, None)


def _check_array(
    data: np.ndarray, datatype: str, shape: tuple[int, ...], numel: int, where: str
) -> np.ndarray:
    if data.size != numel:
        raise ProtocolError(
            f"{where}.contents: expected {numel} element(s) for shape {list(shape)}, "
            f"got {data.size}"
        )
    if data.size and datatype in dt.INTEGER_DATATYPES:
        lo, hi = dt.integer_range(datatype)
        low, high = data.min(), data.max()
        if low < lo or high > hi:
            k = int(np.argmax((data < lo) | (data > hi)))
            raise ProtocolError(
                f"{where}.contents[{k}]: {data[k]} is out of range for {datatype} [{lo}, {hi}]"
            )
    return data


def _values(
    values: list[Any], datatype: str, where: str, offset: int, text: bytes | None
) -> np.ndarray:
    """`values` (the elements `offset`... of an input's data) as a numpy array of the
    datatype (float64 for a float datatype), or a 400 naming the first bad element. `text`,
    the JSON they came from, tells at C speed that every element has the right type."""
    allowed = (_BOOL_CHARS if datatype == "BOOL" else
               _INTEGER_CHARS if datatype in dt.INTEGER_DATATYPES else _NUMBER_CHARS)
    if text is None or text.translate(None, allowed):
        _check_types(values, datatype, where, offset)
    dtype = np.float64 if datatype in dt.FLOAT_DATATYPES else NUMPY_DTYPES[datatype]
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:
        pass
    lo, hi = ((-math.inf, math.inf) if datatype in dt.FLOAT_DATATYPES
              else dt.integer_range(datatype))
    for k, v in enumerate(values):
        try:
            out = not lo <= (float(v) if datatype in dt.FLOAT_DATATYPES else v) <= hi
        except OverflowError:
            out = True
        if out:
            raise ProtocolError(
                f"{where}.data[{offset + k}]: {_show(v)} is out of range for {datatype}"
                + ("" if datatype in dt.FLOAT_DATATYPES else f" [{lo}, {hi}]")
            )
    raise ProtocolError(f"{where}.data: out of range for {datatype}")  # not reached


def _check_types(values: list[Any], datatype: str, where: str, offset: int) -> None:
    if datatype == "BOOL":
        for k, v in enumerate(values):
            if type(v) is not bool:
                raise ProtocolError(
                    f"{where}.data[{offset + k}]: expected true or false, got {_show(v)}"
                )
    elif datatype in dt.INTEGER_DATATYPES:
        for k, v in enumerate(values):
            if type(v) is not int:
                raise ProtocolError(
                    f"{where}.data[{offset + k}]: expected an integer, got {_show(v)}"
                )
    else:
        for k, v in enumerate(values):
            if type(v) is not float and type(v) is not int and not (
                type(v) is str and v in NONFINITE_STRINGS
            ):
                raise ProtocolError(
                    f"{where}.data[{offset + k}]: expected a number (or \"NaN\", "
                    f"\"Infinity\", \"-Infinity\"), got {_show(v)}"
                )


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
        tensor = torch.from_numpy(plan.data).to(dtype).reshape(plan.shape)
    else:
        raw = torch.empty(plan.size, dtype=torch.uint8)
        if plan.region is not None:
            plan.region.read_into(raw.numpy())
        elif plan.size:
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
    entries: Any, parameters: Mapping[str, Any], iface: ModelInterface,
    regions: Lease | None = None,
) -> list[RequestedOutput]:
    default = parameters.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise ProtocolError(
            f"parameters.binary_data_output: expected true or false, got {_show(default)}"
        )
    if entries is None:
        return [RequestedOutput(o, default) for o in iface.outputs]
    if not isinstance(entries, list):
        raise ProtocolError(f"outputs: expected a list, got {_kind(entries)}")
    requested: list[RequestedOutput] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        entry = _object(entry, f"outputs[{i}]")
        name = entry.get("name")
        info = iface.outputs_by_name.get(name) if isinstance(name, str) else None
        if info is None:
            expected = ", ".join(repr(n) for n in iface.outputs_by_name)
            raise ProtocolError(
                f"outputs[{i}].name: unknown output {_show(name)}; model {iface.model!r} has "
                f"{expected}"
            )
        if info.name in seen:
            raise ProtocolError(
                f"outputs[{i}].name: output {info.name!r} requested twice (also "
                f"outputs[{seen[info.name]}])"
            )
        seen[info.name] = i
        params = _object(entry.get("parameters", {}), f"outputs[{i}].parameters")
        unsupported_here = ("classification",) if regions is not None else (
            "classification", "shared_memory_region")
        for unsupported in unsupported_here:
            if unsupported in params:
                raise ProtocolError(f"outputs[{i}].parameters.{unsupported}: not supported")
        binary = params.get("binary_data", default)
        if not isinstance(binary, bool):
            raise ProtocolError(
                f"outputs[{i}].parameters.binary_data: expected true or false, got {_show(binary)}"
            )
        region = None
        if regions is not None and "shared_memory_region" in params:
            region = regions.output(
                params["shared_memory_region"], params.get("shared_memory_offset"),
                params.get("shared_memory_byte_size"), f"outputs[{i}] ({info.name!r})",
            )
        requested.append(RequestedOutput(info, binary, region))
    return requested


# -- responses ------------------------------------------------------------------------------


def encode_response(
    model: str,
    request: InferRequest,
    outputs: list[Any],
    version: str = "1",
) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers; binary outputs follow the JSON header. JSON data
    is written in pieces of `ENCODE_PIECE` values, so an encode on a thread lets the loop run
    between pieces (one `tolist` + `json.dumps` of a large output held the GIL for seconds)."""
    texts: list[str] = []
    blobs: list[bytes] = []
    for wanted in request.outputs:
        value = outputs[wanted.info.position]
        if wanted.region is not None:  # written into its region: the answer has no data
            texts.append(json.dumps(write_to_region(wanted, value), separators=(",", ":")))
            continue
        entry, blob, values = encode_output(wanted.info.name, value, wanted.binary)
        text = json.dumps(entry, separators=(",", ":"))
        if values is not None:
            text = text[:-1] + ',"data":' + _json_values(values) + "}"
        texts.append(text)
        if blob is not None:
            blobs.append(blob)
    doc: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.id is not None:
        doc["id"] = request.id
    head = json.dumps(doc, separators=(",", ":"))
    header = (head[:-1] + ',"outputs":[' + ",".join(texts) + "]}").encode()
    if not blobs:
        return header, {"content-type": JSON_CONTENT_TYPE}
    headers = {"content-type": BINARY_CONTENT_TYPE, HEADER: str(len(header))}
    return b"".join([header, *blobs]), headers


#: Values per piece of a JSON output's data (about 1 ms of `tolist` + `json.dumps`).
ENCODE_PIECE = 1 << 15


#: JSON has no NaN or infinities: a float output's non-finite values are written as these
#: strings (protobuf's JSON mapping of float and double, which JavaScript's Number(), Go's
#: strconv.ParseFloat and numpy's float conversion read), so that strict parsers (JSON.parse,
#: Go's encoding/json) accept the response. Input data accepts them as well as the bare
#: tokens Python and Triton read.
NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_NONFINITE_TOKEN = re.compile(r"-?Infinity|NaN")


def _json_values(tensor: torch.Tensor) -> str:
    """`json.dumps(tensor.reshape(-1).tolist())` (compact), in pieces; a float tensor's
    non-finite values as the strings of `NONFINITE_STRINGS`."""
    flat = tensor.reshape(-1)
    n = flat.numel()
    if n <= ENCODE_PIECE:
        text = json.dumps(flat.tolist(), separators=(",", ":"))
    else:
        parts = [json.dumps(flat[i:i + ENCODE_PIECE].tolist(), separators=(",", ":"))[1:-1]
                 for i in range(0, n, ENCODE_PIECE)]
        text = "[" + ",".join(parts) + "]"
    if flat.is_floating_point() and not bool(torch.isfinite(flat).all()):
        # json.dumps wrote them as the bare tokens NaN, Infinity, -Infinity, which no number
        # it writes contains: quote them
        text = _NONFINITE_TOKEN.sub(r'"\g<0>"', text)
    return text


#: Bytes of JSON per element at most, by datatype ("-1.2345678901234567e-308," for a float:
#: Python's repr of a double), and per output entry besides its data (name, datatype, shape).
JSON_ELEMENT_BYTES = {
    "BOOL": 6, "UINT8": 4, "UINT16": 6, "UINT32": 11, "UINT64": 21, "INT8": 5, "INT16": 7,
    "INT32": 12, "INT64": 21, "FP16": 25, "FP32": 25, "FP64": 25, "BF16": 25,
}
ENTRY_BYTES = 160


def response_bytes(request: InferRequest, outputs: list[Any]) -> int:
    """An upper bound of the response body's size, from the requested outputs' shapes and
    encodings (binary: their bytes; JSON: `JSON_ELEMENT_BYTES` per element): what the server
    checks against --max-response-bytes and what decides to encode off the loop."""
    total = 128
    for wanted in request.outputs:
        value = outputs[wanted.info.position]
        if isinstance(value, torch.Tensor):
            numel, datatype = value.numel(), dt.DATATYPES.get(value.dtype, "FP64")
        else:
            numel, datatype = 1, "FP64"
        per = dt.itemsize(datatype) if wanted.binary else JSON_ELEMENT_BYTES[datatype]
        if wanted.region is not None:  # written into shared memory, not the answer
            per = 0
        total += ENTRY_BYTES + len(wanted.info.name) + numel * per
    return total


def write_to_region(wanted: RequestedOutput, value: Any) -> dict[str, Any]:
    """Write an output asked into a shared memory region there (a 400 naming the region if
    it does not fit); its entry in the answer: name, datatype and shape, as Triton's."""
    assert wanted.region is not None
    entry, blob, _ = encode_output(wanted.info.name, value, binary=True)
    assert blob is not None
    wanted.region.write(blob, wanted.info.name)
    del entry["parameters"]  # no binary data follows
    return entry


def json_request_body(inputs: Mapping[str, Any]) -> bytes:
    """A JSON inference request body carrying these named values (tensors or scalars), as a
    client sends it: what the server's start-up calibration decodes (calibration.py)."""
    entries = []
    for name, value in inputs.items():
        entry, _, values = encode_output(name, value, binary=False)
        assert values is not None
        entries.append({**entry, "data": values.reshape(-1).tolist()})
    return json.dumps({"inputs": entries}, separators=(",", ":")).encode()


def encode_output(
    name: str, value: Any, binary: bool
) -> tuple[dict[str, Any], bytes | None, torch.Tensor | None]:
    """An output's entry without its data, and its data: the binary blob, or the tensor
    to write as JSON."""
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
        return entry, blob, None
    return entry, None, tensor


# -- helpers --------------------------------------------------------------------------------


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {_kind(value)}")
    return value


def _show(value: Any, limit: int = SHOW_CHARS) -> str:
    """A client's value for an error message: its repr, shortened, and never an error (an
    int past Python's 4300-digit str limit is described by its length)."""
    if type(value) is int and value.bit_length() > 4000:
        return f"a {len(format(value, 'x'))}-hex-digit integer"
    if isinstance(value, (list, dict)):
        text = f"{_kind(value)} of {len(value)} item(s)"
    elif isinstance(value, str) and len(value) > limit:
        text = repr(value[:limit]) + f" ({len(value)} characters)"
    else:
        try:
            text = repr(value)
        except ValueError:
            text = _kind(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return type(value) is int


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), f"a {type(value).__name__}"
    )
