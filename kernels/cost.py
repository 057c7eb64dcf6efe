"""A first estimate of a kernel's cost from the shapes the program was exported with.

The number is multiply-adds for contractions (matmul, linear, conv, attention) and elements
touched for everything else. It only has to separate "microseconds" from "worth a thread";
adaptive placement refines it by measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asyncgraph.graph.ir import Graph, Node, Ref, TensorSpec


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _hints(node: Node, graph: Graph) -> list[tuple[int, ...]]:
    shapes = []
    for arg in node.args:
        if isinstance(arg, Ref):
            spec = graph.values[arg.id].spec
            shapes.append(spec.hint if isinstance(spec, TensorSpec) else ())
        else:
            shapes.append(())
    return shapes


def _matmul(node: Node, graph: Graph) -> int:
    shapes = [s for s in _hints(node, graph) if s]
    if len(shapes) < 2:
        return 0
    a, b = shapes[-2], shapes[-1]
    return _numel(a) * (b[-1] if len(b) >= 2 else 1)


def _linear(node: Node, graph: Graph) -> int:
    shapes = _hints(node, graph)
    if len(shapes) < 2 or not shapes[0] or not shapes[1]:
        return 0
    return _numel(shapes[0]) * shapes[1][0]


def _conv(node: Node, graph: Graph) -> int:
    out = graph.values[node.output].spec
    shapes = _hints(node, graph)
    if not isinstance(out, TensorSpec) or len(shapes) < 2 or not shapes[1]:
        return 0
    weight = shapes[1]
    return _numel(out.hint) * _numel(weight[1:])


def _attention(node: Node, graph: Graph) -> int:
    shapes = _hints(node, graph)
    if len(shapes) < 2 or not shapes[0] or not shapes[1]:
        return 0
    q, k = shapes[0], shapes[1]
    return 2 * _numel(q) * k[-2]


_CONTRACTIONS: dict[str, Callable[[Node, Graph], int]] = {
    "aten::mm": _matmul, "aten::bmm": _matmul, "aten::matmul": _matmul,
    "aten::addmm": _matmul, "aten::baddbmm": _matmul, "aten::linear": _linear,
    "aten::_addmm_activation": _matmul,
    "aten::convolution": _conv, "aten::conv1d": _conv, "aten::conv2d": _conv,
    "aten::conv3d": _conv, "aten::_convolution": _conv,
    "aten::scaled_dot_product_attention": _attention,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attention,
    "aten::_native_multi_head_attention": _attention,
}


def estimate_cost(node: Node, graph: Graph) -> int:
    """Estimated work of `node` (0 when unknown)."""
    target: Any = node.target
    if isinstance(target, torch._ops.OpOverload):
        contraction = _CONTRACTIONS.get(target._schema.name)
        if contraction is not None:
            return contraction(node, graph)
        if any(r.alias_info is not None for r in target._schema.returns):
            return 0  # a view: metadata only
    out = graph.values[node.output].spec
    largest = _numel(out.hint) if isinstance(out, TensorSpec) else 0
    for shape in _hints(node, graph):
        largest = max(largest, _numel(shape) if shape else 0)
    return largest
