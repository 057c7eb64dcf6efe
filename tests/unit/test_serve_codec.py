"""The protocol codec against the stock tritonclient's own request builder and response parser.

No server here: bodies made by `InferenceServerClient.generate_request_body` are decoded, and
our responses are parsed with `InferenceServerClient.parse_response_body`, for every datatype.
"""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import sympy
import torch
import tritonclient.http as th

import asyncgraph
from asyncgraph.graph.builder import GraphBuilder
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.serve import ModelInterface, ProtocolError, decode_request, encode_response
from asyncgraph.serve.datatypes import TORCH_DTYPES
from asyncgraph.serve.interface import output_names

CPU = torch.device("cpu")


def identity_graph(dtype: torch.dtype, shape: tuple[Any, ...]) -> Graph:
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(torch.clone, x, name="copy")
    b.output(y)
    graph = b.build()
    hint = tuple(d if isinstance(d, int) else 2 for d in shape)
    graph.values[x.id].spec = TensorSpec(dtype, CPU, shape, hint)
    graph.values[y.id].spec = TensorSpec(dtype, CPU, shape, hint)
    return graph


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
