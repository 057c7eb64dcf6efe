"""The protocol codec against the stock tritonclient's own request builder and response parser.

No server here: bodies made by `InferenceServerClient.generate_request_body` are decoded, and
our responses are parsed with `InferenceServerClient.parse_response_body`, for every datatype.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import sympy
import torch
import tritonclient.http as th
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncgraph
from asyncgraph.serve import ModelInterface, ProtocolError, codec, decode_request, encode_response
from asyncgraph.serve.datatypes import TORCH_DTYPES
from asyncgraph.serve.interface import output_names
from tests.support.serving import identity_graph
from tests.support.strategies import float32s

CPU = torch.device("cpu")


def sample(datatype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = TORCH_DTYPES[datatype]
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.parametrize("datatype", list(TORCH_DTYPES))
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_roundtrip_with_tritonclient(datatype: str, binary: bool) -> None:
    if datatype == "BF16" and not binary:
        pytest.skip("tritonclient refuses BF16 as JSON")
    iface = ModelInterface("m", identity_graph(TORCH_DTYPES[datatype], (2, 3)))
    x = sample(datatype, (2, 3))
    inp = th.InferInput("x", [2, 3], datatype)
    inp.set_data_from_numpy(to_numpy(x), binary_data=binary)
    outputs = [th.InferRequestedOutput("output_0", binary_data=binary)]
    body, json_size = th.InferenceServerClient.generate_request_body([inp], outputs=outputs)
    request = decode_request(body, None if json_size is None else str(json_size), iface)
    assert request.inputs[0].dtype == x.dtype
    assert torch.equal(request.inputs[0], x)

    payload, headers = encode_response("m", request, [x])
    header = headers.get("Inference-Header-Content-Length")
    assert (header is not None) == binary
    result = th.InferenceServerClient.parse_response_body(
        payload, header_length=None if header is None else int(header)
    )
    got = result.as_numpy("output_0")
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, to_numpy(x))


def strict_json(text: str | bytes) -> Any:
    """json.loads as strict parsers (JavaScript's JSON.parse, Go's encoding/json) read
    JSON: NaN, Infinity and -Infinity are not JSON."""

    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


NONFINITE = [1.5, math.nan, math.inf, -math.inf, -0.0, 3e38]


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64", "BF16"])
@pytest.mark.parametrize("n", [len(NONFINITE), 3 * codec.ENCODE_PIECE // 2],
                         ids=["short", "pieces"])
def test_nonfinite_outputs_are_strict_json_strings_that_round_trip(datatype: str, n: int) -> None:
    """Issue 37: `"data":[NaN]` is not JSON. Non-finite values are written as the strings
    "NaN", "Infinity", "-Infinity" (protobuf's JSON mapping); a strict parser reads the
    response, the values come back, tritonclient reads them, and the decoder takes them back
    as input data."""
    dtype = TORCH_DTYPES[datatype]
    values = (NONFINITE * (n // len(NONFINITE) + 1))[:n]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    iface = ModelInterface("m", identity_graph(dtype, (n,)))
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": [n], "data": [0.0] * n}]}
    request = decode_request(json.dumps(doc).encode(), None, iface)
    payload, headers = encode_response("m", request, [x])
    assert headers["content-type"] == "application/json"
    [out] = strict_json(payload)["outputs"]
    data = out["data"]
    assert data[:4] == [float(x[0]), "NaN", "Infinity", "-Infinity"]
    assert {v for v in data if isinstance(v, str)} == {"NaN", "Infinity", "-Infinity"}
    back = torch.tensor([codec.NONFINITE_STRINGS.get(v, v) for v in data], dtype=dtype)
    torch.testing.assert_close(back, x, equal_nan=True, rtol=0, atol=0)
    if datatype != "BF16":  # tritonclient refuses BF16 as JSON
        got = th.InferenceServerClient.parse_response_body(payload).as_numpy("output_0")
        np.testing.assert_array_equal(got, x.numpy())
    # the response's data, sent back as a request's, decodes to the same values
    doc["inputs"][0]["data"] = data
    echoed = decode_request(json.dumps(doc).encode(), None, iface).inputs[0]
    torch.testing.assert_close(echoed, x, equal_nan=True, rtol=0, atol=0)


def test_finite_and_integer_outputs_are_written_as_plain_numbers() -> None:
    iface = ModelInterface("m", identity_graph(torch.int64, (3,)))
    doc = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}]}
    request = decode_request(json.dumps(doc).encode(), None, iface)
    payload, _ = encode_response("m", request, [torch.tensor([1, -2, 3])])
    assert b'"data":[1,-2,3]' in payload
    payload, _ = encode_response("m", request, [torch.tensor([0.5, -1e30, 2.0])])
    assert strict_json(payload)["outputs"][0]["data"] == [0.5, float(torch.tensor(-1e30)), 2.0]


@pytest.mark.parametrize("bad", ["nan", "inf", "1.5", ""])
def test_other_strings_in_float_data_are_refused(bad: str) -> None:
    iface = ModelInterface("m", identity_graph(torch.float32, (2,)))
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, bad]}]}
    with pytest.raises(ProtocolError, match=r"data\[1\]: expected a number \(or \"NaN\""):
        decode_request(json.dumps(doc).encode(), None, iface)


def test_nested_and_flat_json_data_agree() -> None:
    iface = ModelInterface("m", identity_graph(torch.float32, (2, 2)))
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": None}]}
    decoded = []
    for data in ([[1, 2], [3, 4.5]], [1, 2, 3, 4.5]):
        doc["inputs"][0]["data"] = data
        decoded.append(decode_request(json.dumps(doc).encode(), None, iface).inputs[0])
    assert torch.equal(decoded[0], decoded[1])
    assert decoded[0].tolist() == [[1.0, 2.0], [3.0, 4.5]]


def test_dynamic_dimensions_are_minus_one_and_checked_against_their_range() -> None:
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    graph = identity_graph(torch.float32, (s0, 3))
    graph.signature.range_constraints[s0] = (1, 8)
    iface = ModelInterface("m", graph)
    assert iface.metadata()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]

    def body(n: int) -> bytes:
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [n, 3],
                           "data": [0.0] * (3 * n)}]}
        return json.dumps(doc).encode()

    assert decode_request(body(8), None, iface).inputs[0].shape == (8, 3)
    with pytest.raises(ProtocolError, match=r"shape\[0\]: expected a size in \[1, 8\], got 9"):
        decode_request(body(9), None, iface)


def test_huge_shape_is_refused_before_allocating() -> None:
    iface = ModelInterface("m", identity_graph(torch.float32, (sympy.Symbol("s0"), 3)))
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [10**12, 3],
                       "parameters": {"binary_data_size": 12}}]}
    header = json.dumps(doc).encode()
    with pytest.raises(ProtocolError, match="binary_data_size: expected 12000000000000 bytes"):
        decode_request(header + b"\0" * 12, str(len(header)), iface)


def test_output_names_follow_the_output_structure() -> None:
    def names(tree: Any) -> list[str]:
        from torch.utils import _pytree as pytree

        leaves, spec = pytree.tree_flatten(tree)
        return output_names(spec, len(leaves))

    assert names(0) == ["output_0"]
    assert names((0, 1)) == ["output_0", "output_1"]
    assert names({"logits": 0, "cache": (1, 2)}) == ["logits", "cache.0", "cache.1"]
    assert names(((0, 1), 2)) == ["output_0.0", "output_0.1", "output_1"]


def test_inputs_fixed_at_export_are_filled_in_and_not_listed() -> None:
    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, scale: float = 2.0) -> dict[str, torch.Tensor]:
            return {"y": x * scale, "total": x.sum()}

    ep = torch.export.export(Scaled(), (torch.randn(3),), {"scale": 2.0})
    program = asyncgraph.to_program(ep)
    iface = ModelInterface("m", program.graph)
    meta = iface.metadata()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [3]}]
    assert meta["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [3]},
        {"name": "total", "datatype": "FP32", "shape": []},
    ]
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}],
           "outputs": [{"name": "total"}]}
    request = decode_request(json.dumps(doc).encode(), None, iface)
    assert request.inputs[1] == 2.0 and [o.info.name for o in request.outputs] == ["total"]
    bad = {"inputs": [*doc["inputs"], {"name": "scale", "datatype": "FP64", "shape": [],
                                       "data": [3.0]}]}
    with pytest.raises(ProtocolError, match="unknown input 'scale'; model 'm' expects 'x'"):
        decode_request(json.dumps(bad).encode(), None, iface)


# -- hostile bodies (issue 39) ----------------------------------------------------------------
#
# The decoder's contract: any body either decodes or raises ProtocolError with a 4xx status,
# never another exception (each was a 500 counted as a BACKEND failure). The fuzz builds
# documents over the request schema (valid and invalid values for every field), encodes them,
# and sometimes damages the bytes; a second fuzz checks that data arrays parsed in pieces give
# what `json.loads` gives.

_S0 = sympy.Symbol("s0", positive=True, integer=True)
_FUZZ_DATATYPES = [*TORCH_DTYPES, "BYTES", "fp32", ""]

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
)
_json_values = st.recursive(
    _scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                      st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)
_dims = st.one_of(st.integers(min_value=-2, max_value=6), st.sampled_from([10**19, 10**4299]),
                  _scalars)
_data = st.one_of(
    st.lists(st.one_of(float32s, st.integers(-300, 300)), max_size=24),
    st.lists(st.lists(st.floats(allow_nan=False), max_size=6), max_size=4),
    st.lists(st.booleans(), max_size=12),
    st.lists(_scalars, max_size=6),
    _json_values,
)
_parameters = st.one_of(
    st.fixed_dictionaries({}, optional={
        "timeout": st.one_of(st.integers(min_value=-5, max_value=10**400), _scalars),
        "binary_data_output": _scalars,
        "binary_data_size": _scalars,
    }),
    _json_values,
)
_entries = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["x", "y", ""]), _scalars),
    "datatype": st.one_of(st.sampled_from(_FUZZ_DATATYPES), _scalars),
    "shape": st.one_of(st.lists(_dims, max_size=4), _json_values),
    "data": _data,
    "parameters": _parameters,
})
_outputs = st.one_of(
    st.none(),
    st.lists(st.fixed_dictionaries({}, optional={
        "name": st.one_of(st.sampled_from(["output_0", "z"]), _scalars),
        "parameters": _parameters,
    }), max_size=3),
    _json_values,
)
_documents = st.one_of(
    st.fixed_dictionaries({}, optional={
        "id": _scalars, "inputs": st.one_of(st.lists(_entries, max_size=3), _json_values),
        "outputs": _outputs, "parameters": _parameters,
    }),
    _json_values,
)


def _fuzz_iface(datatype: str) -> ModelInterface:
    return ModelInterface("m", identity_graph(TORCH_DTYPES[datatype], (_S0, 3)))


_IFACES = {d: _fuzz_iface(d) for d in ("FP32", "INT8", "BOOL", "UINT64", "BF16")}


def _decodes_or_refuses(body: bytes, header: str | None, iface: ModelInterface,
                        **limits: Any) -> None:
    try:
        decode_request(body, header, iface, **limits)
    except ProtocolError as exc:
        assert 400 <= exc.status < 500, exc
        assert len(exc.message) < 2000, exc.message[:200]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_documents, datatype=st.sampled_from(list(_IFACES)),
       damage=st.one_of(st.none(), st.tuples(st.integers(0, 400), st.binary(max_size=6))),
       binary=st.one_of(st.none(), st.tuples(st.integers(-2, 600), st.binary(max_size=48))),
       max_json_bytes=st.sampled_from([1 << 20, 64]))
def test_fuzz_any_body_decodes_or_is_a_4xx(
    doc: Any, datatype: str, damage: Any, binary: Any, max_json_bytes: int
) -> None:
    body = json.dumps(doc).encode()
    if damage is not None:
        at, junk = damage
        body = body[:at] + junk + body[at + len(junk) // 2:]
    header = None
    if binary is not None:
        length, blob = binary
        header = str(length if length != -2 else len(body))
        body += blob
    _decodes_or_refuses(body, header, _IFACES[datatype], max_json_bytes=max_json_bytes)


@pytest.mark.parametrize("body", [
    b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": '
    + b"[" * 100_000 + b"1" + b"]" * 100_000 + b"}]}",
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1'
    + b"0" * 400 + b", 1, 1]}]}",
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1e999, 1, 1]}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [' + b"9" * 4300
    + b', 3], "data": [1, 1, 1]}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 1, 1]}], '
    b'"parameters": {"timeout": 1' + b"0" * 400 + b"}}",
    b'{"inputs": [{"name": "' + b"n" * 100_000 + b'", "datatype": "FP32"}]}',
], ids=["nested 5000", "data nested 100000", "int past float", "1e999", "4300-digit dim",
        "timeout 10**400", "100 KB name"])
def test_the_issues_bodies_are_4xx(body: bytes) -> None:
    _decodes_or_refuses(body, None, _IFACES["FP32"])


@settings(max_examples=150, deadline=None)
@given(datatype=st.sampled_from(["FP32", "INT8", "BOOL", "UINT64", "BF16"]),
       rows=st.integers(0, 40), nested=st.booleans(), spaces=st.booleans(),
       piece=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_data_parsed_in_pieces_equals_json_loads(
    datatype: str, rows: int, nested: bool, spaces: bool, piece: int, seed: int
) -> None:
    """With tiny pieces, an array is cut at many commas: the tensor is what a whole parse
    gives, for flat, nested and spaced arrays, and any malformed variant is a 4xx."""
    x = sample(datatype, (rows, 3)) if rows else torch.empty(0, 3, dtype=TORCH_DTYPES[datatype])
    if datatype in ("INT8", "UINT64"):
        x = torch.randint(-128 if datatype == "INT8" else 0, 127, (rows, 3),
                          generator=torch.Generator().manual_seed(seed)).to(x.dtype)
    values = x.tolist() if nested else x.reshape(-1).tolist()
    separators = (", ", ": ") if spaces else (",", ":")
    doc = {"inputs": [{"name": "x", "datatype": datatype, "shape": [rows, 3], "data": values}]}
    body = json.dumps(doc, separators=separators).encode()
    iface = _IFACES[datatype]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec, "PIECE_BYTES", piece)
        mp.setattr(codec, "CUT_BYTES", 1)
        got = decode_request(body, None, iface).inputs[0]
        assert isinstance(doc_of(body)["inputs"][0]["data"], codec.RawArray) or rows == 0
        assert torch.equal(got, x)
        for bad in (b",]", b"[,", b", ,", b"1 1", b"][", b'"1"'):
            damaged = body.replace(b",", bad, 1) if rows else body
            _decodes_or_refuses(damaged, None, iface)


def doc_of(body: bytes) -> Any:
    return codec.parse_document(body)


def test_json_outside_the_data_arrays_is_bounded_by_max_json_bytes() -> None:
    iface = _IFACES["FP32"]
    x = torch.randn(4000, 3)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4000, 3],
                       "data": x.reshape(-1).tolist()}]}
    body = json.dumps(doc).encode()
    # the data array is 200 KB, parsed in pieces: a 1 KB limit for the rest admits it
    assert torch.equal(decode_request(body, None, iface, max_json_bytes=1024).inputs[0], x)
    junk = json.dumps({**doc, "junk": [[]] * 2000}).encode()
    with pytest.raises(ProtocolError, match=r"JSON outside its data arrays, over the limit of "
                       r"1024 bytes \(--max-json-bytes\)") as info:
        decode_request(junk, None, iface, max_json_bytes=1024)
    assert info.value.status == 413
    nested_with_an_empty_row = json.dumps(
        {"inputs": [{**doc["inputs"][0], "data": [*x.tolist(), []]}]}).encode()
    with pytest.raises(ProtocolError, match=r"data: expected 12000 element\(s\) for shape "
                       r"\[4000, 3\], got 12001 \(counted by its commas"):
        decode_request(nested_with_an_empty_row, None, iface, max_json_bytes=1024)
    irregular = [*x.reshape(-1).tolist()[:-1], []]  # as many commas as values, one empty
    padded = json.dumps({"inputs": [{**doc["inputs"][0], "data": irregular}]}).encode()
    with pytest.raises(ProtocolError, match=r"data: not a flat or evenly nested JSON array") \
            as info:
        decode_request(padded, None, iface, max_json_bytes=1024)
    assert info.value.status == 413
    got = decode_request(nested_with_an_empty_row, None, iface).inputs[0]  # within 1 MB
    assert torch.equal(got, x)


def test_outputs_requested_twice_are_refused_and_responses_are_estimated() -> None:
    iface = _IFACES["FP32"]
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1.0] * 6}],
           "outputs": [{"name": "output_0"}] * 2}
    with pytest.raises(ProtocolError, match=r"outputs\[1\].name: output 'output_0' requested "
                       r"twice \(also outputs\[0\]\)"):
        decode_request(json.dumps(doc).encode(), None, iface)
    x = torch.randn(100_000, 3)
    for binary in (False, True):
        doc["outputs"] = [{"name": "output_0", "parameters": {"binary_data": binary}}]
        request = decode_request(json.dumps(doc).encode(), None, iface)
        payload, _ = encode_response("m", request, [x])
        estimate = codec.response_bytes(request, [x])
        assert len(payload) <= estimate < 2 * len(payload) + 1024
    # JSON written in pieces is what one json.dumps writes
    doc["outputs"] = [{"name": "output_0"}]
    request = decode_request(json.dumps(doc).encode(), None, iface)
    payload, _ = encode_response("m", request, [x])
    whole = {"model_name": "m", "model_version": "1", "outputs": [
        {"name": "output_0", "datatype": "FP32", "shape": [100_000, 3],
         "data": x.reshape(-1).tolist()}]}
    assert payload == json.dumps(whole, separators=(",", ":")).encode()


def test_large_json_is_parsed_with_the_collector_paused_and_restored() -> None:
    """The pause (0.55-0.75 s of full collections in a 1 MB parse of `[],` in a process with
    torch imported, against 0.06 s without) nests across concurrent decodes and leaves a
    collector that was off, off."""
    import gc

    assert gc.isenabled()
    with codec._gc_paused(codec.GC_PAUSE_BYTES + 1):
        assert not gc.isenabled()
        with codec._gc_paused(codec.GC_PAUSE_BYTES + 1):
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer parse is still running
    assert gc.isenabled()
    with codec._gc_paused(codec.GC_PAUSE_BYTES):
        assert gc.isenabled()  # small texts: no pause
    gc.disable()
    try:
        with codec._gc_paused(codec.GC_PAUSE_BYTES + 1):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ProtocolError, match="not valid JSON"):
        codec._loads(b"[1" + b", 1" * codec.GC_PAUSE_BYTES + b",]", "request body")
    assert gc.isenabled()


def test_nesting_is_bounded_whatever_the_recursion_limit() -> None:
    """A library that raises the recursion limit (torch's compilers do) must not let a deeply
    nested body through: the bound is the codec's own (it was json.loads' RecursionError, and
    a 1000-deep body then reached the schema check under xdist)."""
    from asyncgraph.serve.codec import MAX_JSON_DEPTH, parse_document

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
        assert parse_document(ok) is not None
        for depth in (MAX_JSON_DEPTH + 1, 5_000):
            with pytest.raises(ProtocolError, match="JSON nested too deeply") as info:
                parse_document(b"[" * depth + b"]" * depth)
            assert info.value.status == 400
    finally:
        sys.setrecursionlimit(limit)
