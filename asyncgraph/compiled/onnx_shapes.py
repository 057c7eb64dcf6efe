"""Static-shape rewrites of a segment's ONNX model: layout moves that are reshapes, as Reshapes.

At batch 1, much of a transformer's layout work moves only dimensions of size 1: torch's
batch-first MultiheadAttention transposes (batch, seq, hidden) to (seq, batch, hidden) and
back, squeezes and unsqueezes around its projections. Such a Transpose, Squeeze or Unsqueeze
keeps every element where it is, so it is a Reshape, which ONNX Runtime runs as a view where
its Transpose copies (and, with an intra-op pool, may hand the copy to the pool's threads);
and a Reshape of a Reshape read by nothing else is one Reshape. With both, tiny BERT and the
suite's encoder at batch 1 ran slightly faster
(benchmarks/results/cpu/design_measurements.md#onnx-layout-reshapes).

Only where the exporter recorded every dimension of a node's input and output as a number
(static segments; a symbolic batch dimension keeps its nodes), never on an initializer (ONNX
Runtime folds those), and not in models with subgraphs (If, Loop, Scan read values by name). The
delegate's first call on each signature still checks the session against the plain nodes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from onnx import AttributeProto, helper, numpy_helper

LAYOUT_MOVES = frozenset({"Transpose", "Squeeze", "Unsqueeze"})
_SUBGRAPHS = (AttributeProto.GRAPH, AttributeProto.GRAPHS)


def reshapes_simplified(proto: Any) -> Any:
    """`proto` with its size-1 layout moves as Reshapes and its Reshape chains folded (the
    module docstring); the same object, changed in place, or unchanged when nothing applies."""
    graph = proto.graph
    if proto.functions or any(a.type in _SUBGRAPHS for n in graph.node for a in n.attribute):
        return proto
    shapes = _static_shapes(graph)
    constants = {i.name for i in graph.initializer}
    kept_names = {o.name for o in graph.output}
    readers = Counter(name for node in graph.node for name in node.input)
    shape_inputs: dict[tuple[int, ...], str] = {}

    def shape_input(shape: tuple[int, ...]) -> str:
        name = shape_inputs.get(shape)
        if name is None:
            name = shape_inputs[shape] = f"asyncgraph_shape_{len(shape_inputs)}"
            graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), name))
        return name

    nodes: list[Any] = []
    made_by: dict[str, int] = {}  # a Reshape's output -> its position in `nodes`
    dropped: set[int] = set()
    for node in graph.node:
        out = shapes.get(node.output[0]) if len(node.output) == 1 else None
        if out is None or 0 in out or not node.input:
            nodes.append(node)
            continue
        data = node.input[0]
        if node.op_type in LAYOUT_MOVES and data not in constants and _moves_size_1_only(
                node, shapes.get(data)):
            node = helper.make_node("Reshape", [data, shape_input(out)], list(node.output),
                                    name=f"asyncgraph_reshape_{node.output[0]}")
        if node.op_type == "Reshape":
            first = made_by.get(data)
            if first is not None and readers[data] == 1 and data not in kept_names:
                dropped.add(first)
                node = helper.make_node("Reshape", [nodes[first].input[0], shape_input(out)],
                                        list(node.output), name=node.name)
            made_by[node.output[0]] = len(nodes)
        nodes.append(node)
    if not shape_inputs:  # every rewrite above asks for a shape input: nothing changed
        return proto
    del graph.node[:]
    graph.node.extend(n for k, n in enumerate(nodes) if k not in dropped)
    return proto


def _moves_size_1_only(node: Any, shape: tuple[int, ...] | None) -> bool:
    """Whether the Transpose keeps the order of its input's dimensions larger than 1 (then it
    moves no element), or the node is a Squeeze or Unsqueeze (which never do), on a static
    input."""
    if shape is None:
        return False
    if node.op_type != "Transpose":
        return True
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"),
                list(range(len(shape)))[::-1])
    moved = [axis for axis in perm if shape[axis] != 1]
    return moved == sorted(moved)


def _static_shapes(graph: Any) -> dict[str, tuple[int, ...]]:
    """The shapes the exporter recorded with every dimension a number, by value name."""
    shapes = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[info.name] = tuple(int(d.dim_value) for d in dims)
    return shapes

