"""Graph validation: each malformed graph gets an error naming the node, with the graph printed."""

from __future__ import annotations

import operator

import pytest
import torch

from asyncgraph import GraphBuilder, GraphValidationError, UnsupportedOpsError
from asyncgraph.graph.ir import (
    Graph,
    InputKind,
    InputSpec,
    Node,
    OutputKind,
    OutputSpec,
    Ref,
    Signature,
    Value,
)
from asyncgraph.kernels import KernelFactory


def _graph(nodes: list[Node], values: list[Value], outputs: list[int]) -> Graph:
    sig = Signature(
        (InputSpec(InputKind.USER_INPUT, 0, "args[0]"),),
        tuple(OutputSpec(OutputKind.USER_OUTPUT, Ref(o)) for o in outputs),
    )
    return Graph(values, nodes, sig)


def test_cycle_is_rejected_naming_its_nodes() -> None:
    values = [Value(0, "x"), Value(1, "a", 0), Value(2, "b", 1)]
    nodes = [
        Node(0, "a", operator.add, (Ref(0), Ref(2)), {}, 1),
        Node(1, "b", operator.neg, (Ref(1),), {}, 2),
    ]
    with pytest.raises(GraphValidationError) as info:
        _graph(nodes, values, [2])
    message = str(info.value)
    assert message.startswith("the graph has a cycle through nodes a, b\n\ngraph(")
    assert "%b = _operator.neg(%a)" in message


def test_dangling_value_is_rejected() -> None:
    values = [Value(0, "x"), Value(1, "a", 0)]
    nodes = [Node(0, "a", operator.neg, (Ref(7),), {}, 1)]
    with pytest.raises(GraphValidationError) as info:
        _graph(nodes, values, [1])
    assert str(info.value).startswith(
        "node %a (_operator.neg) reads value id 7, which does not exist (dangling value)"
    )
    assert "%a = _operator.neg(%<missing 7>)" in str(info.value)


def test_duplicate_names_are_rejected() -> None:
    values = [Value(0, "x"), Value(1, "x", 0)]
    nodes = [Node(0, "y", operator.neg, (Ref(0),), {}, 1)]
    with pytest.raises(GraphValidationError, match=r"^duplicate name 'x'\n"):
        _graph(nodes, values, [1])


def test_unknown_op_is_rejected() -> None:
    values = [Value(0, "x"), Value(1, "a", 0)]
    nodes = [Node(0, "a", "aten::frobnicate", (Ref(0),), {}, 1)]  # type: ignore[arg-type]
    with pytest.raises(GraphValidationError) as info:
        _graph(nodes, values, [1])
    assert str(info.value).startswith(
        "node %a: unknown op 'aten::frobnicate' (its target is not callable)"
    )


def test_use_before_definition_is_rejected() -> None:
    values = [Value(0, "x"), Value(1, "a", 0), Value(2, "b", 1)]
    nodes = [
        Node(0, "a", operator.neg, (Ref(2),), {}, 1),
        Node(1, "b", operator.neg, (Ref(0),), {}, 2),
    ]
    with pytest.raises(GraphValidationError, match=r"^node %a reads %b before it is defined"):
        _graph(nodes, values, [1])


def test_builder_rejects_duplicate_input_names() -> None:
    b = GraphBuilder()
    b.input("x")
    with pytest.raises(ValueError, match="duplicate name 'x'"):
        b.input("x")


def test_all_unsupported_ops_are_reported_at_once() -> None:
    class Mystery(torch._ops.HigherOrderOperator):
        def __init__(self, name: str) -> None:
            super().__init__(name)

        def __call__(self, *args: object) -> object:
            return super().__call__(*args)

    first, second = Mystery("mystery_one"), Mystery("mystery_two")
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(first, x, name="a")
    c = b.call(second, a, name="c")
    d = b.call(first, c, name="d")
    b.output(d)
    with pytest.raises(UnsupportedOpsError) as info:
        KernelFactory().create(b.build())
    assert str(info.value) == (
        "2 op(s) of the graph have no kernel:\n"
        "  torch.ops.higher_order.mystery_one (nodes: a, d)\n"
        "  torch.ops.higher_order.mystery_two (nodes: c)"
    )
    assert info.value.ops == [
        "torch.ops.higher_order.mystery_one",
        "torch.ops.higher_order.mystery_two",
    ]


def test_format_prints_inputs_nodes_and_outputs() -> None:
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(operator.mul, x, 2, name="double")
    b.output({"y": y, "k": 3})
    text = b.build().format()
    assert text == (
        "graph(\n    %x : user_input target='x'\n):\n"
        "    %double = _operator.mul(%x, 2)\n    return (%double, 3)"
    )
