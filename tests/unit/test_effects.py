"""The ordering edges a Graph gives its side effects (asyncgraph/graph/effects.py)."""

from __future__ import annotations

import torch

from asyncgraph import GraphBuilder
from asyncgraph.compiled.segments import uncompilable_reason
from asyncgraph.graph.importers import from_graph_module
from asyncgraph.graph.ir import Graph
from asyncgraph.passes.rewrite import rebuild


def _after(graph: Graph, name: str) -> list[str]:
    return [graph.values[v].name for v in graph.node(name).after]


def noop(*xs: object) -> int:
    return 0


def test_declared_states_chain_in_graph_order() -> None:
    b = GraphBuilder()
    x = b.input("x")
    b.call(noop, x, name="a", effects="log")
    b.call(noop, x, name="pure")
    b.call(noop, x, name="other", effects="elsewhere")
    b.call(noop, x, name="b", effects=("log", "elsewhere"))
    c = b.call(noop, x, name="c", effects="log")
    b.output(c)
    graph = b.build()
    assert _after(graph, "a") == []
    assert _after(graph, "pure") == []
    assert _after(graph, "b") == ["a", "other"]
    assert _after(graph, "c") == ["b"]
    assert "# after %a, %other" in graph.format()
    assert graph.effect_nodes == {0, 2, 3, 4}


def test_a_ref_state_orders_the_nodes_that_name_its_object() -> None:
    b = GraphBuilder()
    obj = b.input("obj")
    first = b.call(noop, obj, name="first", effects=obj)
    b.call(noop, obj, name="second", effects=obj)
    b.output(first)
    graph = b.build()
    assert _after(graph, "second") == ["first"]


def test_rebuild_orders_effects_anew() -> None:
    """A pass that drops and renumbers nodes keeps the declared states (Refs remapped) and
    recomputes `after` from them."""
    b = GraphBuilder()
    x = b.input("x")
    obj = b.input("obj")
    b.call(noop, x, name="dropped")
    first = b.call(noop, x, name="first", effects=obj)
    second = b.call(noop, x, name="second", effects=obj)
    b.output((first, second))
    graph = b.build()
    again = rebuild(graph, graph.nodes[1:])
    assert _after(again, "second") == ["first"]
    assert again.node("second").effects == (again.node("first").effects[0],)


class InPlace(torch.nn.Module):
    """An fx graph (not functionalized) writing a view of its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = x + 1
        v = torch.ops.aten.view.default(x, [-1])
        torch.ops.aten.add_.Tensor(v, 1)
        after = x * 2
        return before + after.view(before.shape)


def test_a_write_through_a_view_orders_readers_of_its_base() -> None:
    graph = from_graph_module(torch.fx.symbolic_trace(InPlace())).graph
    write = next(n for n in graph.nodes if n.target is torch.ops.aten.add_.Tensor)
    assert "add" in _after(graph, write.name)  # `before` reads x: it runs first
    assert write.name in _after(graph, "mul")  # `after` reads x: it runs after the write
    reason = uncompilable_reason(write, graph)
    assert reason is not None and "side effects" in reason
