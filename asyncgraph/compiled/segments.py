"""Which nodes of a graph AOTInductor compiles: segments, runs of consecutive compilable nodes.

A segment is a run of nodes that are consecutive in the graph's (topological) node order. Such
a run is convex: a path between two of its nodes only passes through nodes whose positions lie
between theirs, all inside the run, so replacing the run by one node never makes a cycle.

A node is compilable when it is a CPU aten operator (a torch._ops.OpOverload that is neither
CUDA nor random: a compiled random op would draw other numbers than the plain graph; a random
op whose arguments turn its randomness off, such as eval-mode dropout and attention without
dropout, draws nothing and is compilable), or an
`operator.getitem` of a value made inside the same segment. Higher-order ops (cond, while_loop,
map), Python callables, coroutines and CUDA nodes stay interpreted, and split the runs; the
Python arithmetic of sizes (SIZE_ARITHMETIC) is compiled with its segment.

`whole` keeps every run; `auto` keeps the runs long enough (or costly enough) for fusion to
pay for the call into compiled code: a lone matmul runs the same kernel either way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from asyncgraph.graph.ir import Graph, Node, Ref, Signature, TensorSpec, Value, iter_refs
from asyncgraph.kernels.cost import estimate_cost
from asyncgraph.passes.identity import draws_nothing
from asyncgraph.passes.rewrite import rebuild

MODES = ("auto", "whole")
AUTO_MIN_NODES = 8  # auto: a run this long is compiled...
AUTO_MIN_COST = 2**24  # ...and so is a shorter one (two nodes or more) doing this much work


@dataclass(frozen=True)
class Segment:
    """Nodes `start..stop-1` of the graph, the values they read from outside (`inputs`, value
    ids in first-use order) and those read after them (`outputs`: by later nodes or the
    graph's outputs)."""

    index: int
    start: int
    stop: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"aoti_segment_{self.index}"

    def nodes(self, graph: Graph) -> list[Node]:
        return graph.nodes[self.start:self.stop]


def uncompilable_reason(node: Node, graph: Graph) -> str | None:
    """Why `node` cannot be in a segment, or None when it can."""
    target = node.target
    if target is operator.getitem:
        return None  # inside a segment only when what it indexes is (checked by find_segments)
    if target in SIZE_ARITHMETIC:
        return None  # size arithmetic (export traces it); a SymInt never crosses a boundary

    if not isinstance(target, torch._ops.OpOverload):
        return f"{node.target_name()} is not an aten operator"
    if node.index in graph.effect_nodes:  # its order with them is kept by edges (effects.py)
        return f"{target} touches state that side effects change"
    if torch.Tag.nondeterministic_seeded in target.tags and not draws_nothing(node, target):
        return f"{target} is random (compiled code would draw other numbers)"
    for vid in [node.output, *node.inputs()]:
        spec = graph.values[vid].spec
        if isinstance(spec, TensorSpec) and spec.device.type != "cpu":
            return f"{target} runs on {spec.device}"
    for arg in _leaves((node.args, node.kwargs)):
        if isinstance(arg, torch.Tensor):
            return f"{target} has a tensor constant argument"
    return None


# Python arithmetic that dynamic-shape exports put between sym_size and the views reading it
# (`mul_78 = sym_size_int * 4`): compiled with its segment, so that the size stays inside it
# (a segment's boundary carries tensors only, and a SymInt crossing it would split the run).
SIZE_ARITHMETIC = frozenset({
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
})



def find_segments(
    graph: Graph,
    mode: str = "auto",
    excluded: Collection[int] = (),
    *,
    min_nodes: int = AUTO_MIN_NODES,
    min_cost: int = AUTO_MIN_COST,
) -> list[Segment]:
    """The segments of `graph` for `mode` ("auto" or "whole"); `excluded` are node indices
    that must stay interpreted (found unfit when the segments were tried)."""
    if mode not in MODES:
        raise ValueError(f"segments mode {mode!r}: expected one of {', '.join(MODES)}")
    runs = _runs(graph, set(excluded))
    if mode == "auto":
        runs = [r for r in runs if _worth_compiling(graph, r, min_nodes, min_cost)]
    else:
        runs = [r for r in runs if _compute_nodes(graph, r) >= 1]
    segments = [_segment(graph, 0, start, stop) for start, stop in runs]
    return [
        Segment(i, s.start, s.stop, s.inputs, s.outputs)
        for i, s in enumerate(s for s in segments if s.outputs)
    ]


def tensor_bounded_segments(
    graph: Graph, mode: str, is_tensor: Callable[[int], bool], excluded: Collection[int] = (),
    *, min_nodes: int = AUTO_MIN_NODES,
) -> list[Segment]:
    """The segments, narrowed until every value crossing a boundary is a tensor (`is_tensor`
    of its value id): compiled and scripted segments take and return tensors only."""
    excluded = set(excluded)
    while True:
        segments = find_segments(graph, mode, excluded, min_nodes=min_nodes)
        before = len(excluded)
        for segment in segments:
            inside = set(range(segment.start, segment.stop))
            for vid in segment.inputs:
                if not is_tensor(vid):  # keep its readers out
                    excluded |= {n.index for n in segment.nodes(graph) if vid in n.inputs()}
            for vid in segment.outputs:
                if not is_tensor(vid):  # keep its producer out
                    producer = graph.values[vid].producer
                    if producer is not None and producer in inside:
                        excluded.add(producer)
        if len(excluded) == before:
            return segments


@dataclass
class SplicedValues:
    """What rebuild() reads of a graph: its values and signature (here with the delegate
    values added, which no Graph holds yet)."""

    values: list[Value]
    signature: Signature


def replace_segments(
    graph: Graph, segments: Sequence[Segment], delegate: Callable[[Segment], tuple[str, Any]],
) -> Graph:
    """`graph` with each segment's nodes replaced by one node calling `delegate(segment)`'s
    target (named by it) on the segment's inputs, and a getitem node per output that keeps the
    name and value of the node that made it."""
    values = list(graph.values)
    by_start = {s.start: s for s in segments}
    nodes: list[Node] = []
    i = 0
    while i < len(graph.nodes):
        segment = by_start.get(i)
        if segment is None:
            nodes.append(graph.nodes[i])
            i += 1
            continue
        name, target = delegate(segment)
        result = len(values)
        values.append(Value(result, name))
        nodes.append(Node(graph.nodes[i].index, name, target,
                          tuple(Ref(v) for v in segment.inputs), {}, result))
        for k, vid in enumerate(segment.outputs):
            producer = graph.nodes[cast(int, graph.values[vid].producer)]
            nodes.append(Node(producer.index, producer.name, operator.getitem,
                              (Ref(result), k), {}, vid))
        i = segment.stop
    return rebuild(cast(Graph, SplicedValues(values, graph.signature)), nodes)


def _runs(graph: Graph, excluded: set[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for node in graph.nodes:
        ok = node.index not in excluded and uncompilable_reason(node, graph) is None
        if ok and node.target is operator.getitem:  # only of a value made in this run
            producer = _producer(graph, node)
            ok = start is not None and producer is not None and producer >= start
        if ok and start is None:
            start = node.index
        elif not ok and start is not None:
            runs.append((start, node.index))
            start = None
    if start is not None:
        runs.append((start, len(graph.nodes)))
    return runs


def _producer(graph: Graph, node: Node) -> int | None:
    first = node.args[0] if node.args else None
    return graph.values[first.id].producer if isinstance(first, Ref) else None


def _compute_nodes(graph: Graph, run: tuple[int, int]) -> int:
    return sum(1 for n in graph.nodes[run[0]:run[1]] if n.target is not operator.getitem)


def _worth_compiling(graph: Graph, run: tuple[int, int], min_nodes: int, min_cost: int) -> bool:
    count = _compute_nodes(graph, run)
    if count >= min_nodes:
        return True
    cost = sum(estimate_cost(n, graph) for n in graph.nodes[run[0]:run[1]])
    return count >= 2 and cost >= min_cost


def _segment(graph: Graph, index: int, start: int, stop: int) -> Segment:
    inside = {graph.nodes[i].output for i in range(start, stop)}
    inputs: dict[int, None] = {}
    for node in graph.nodes[start:stop]:
        for vid in node.inputs():
            if vid not in inside:
                inputs.setdefault(vid, None)
    used_after: set[int] = set()
    for node in graph.nodes[stop:]:
        used_after.update(node.inputs())
    for out in graph.signature.outputs:
        used_after.update(ref.id for ref in iter_refs(out.arg))
    outputs = tuple(graph.nodes[i].output for i in range(start, stop)
                    if graph.nodes[i].output in used_after)
    return Segment(index, start, stop, tuple(inputs), outputs)


def _leaves(obj: object) -> Sequence[object]:
    found: list[object] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            found.append(item)
    return found
