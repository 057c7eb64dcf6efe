"""Linear lowering: `linear` over a 2-D input runs as `addmm` with its weight's transpose folded.

Why: for a 2-D input with a bias, `at::linear` is `addmm(bias, input, weight.t())`: its
Python binding parses three arguments, then it dispatches `t` (a new view of the weight, made
on every call) and `addmm`. With the transpose a node of its own that reads only a weight,
constant folding computes it once per weights version (and again on swap_weights), so each
call is one `addmm`. Measured on this project's 2-core machine (torch 2.11, one thread, batch
1, 256 wide): one call 0.90x the time of `linear`; 12 Linear+ReLU layers in a loop 0.91-0.93x.
It is also the form a core-ATen graph already has (`permute(W, [1, 0])` before each `addmm`).

What is lowered, exactly: `aten.linear.default(x, W, b)` whose `W` is a 2-D weight input
(a parameter, buffer or constant that no execution mutates, as folding requires), whose `b`
is present, whose `x` is 2-D, all on the CPU.
The result is bitwise the same: the op this writes is the one `at::linear` calls. Left alone:
other ranks (for a 3-D input `at::linear` flattens the input inside one call; the same three
steps as separate Python calls timed 9-15% slower), no bias (a `matmul`), CUDA (not measured).
The lowered node keeps the linear's name (errors, profiles and traces name it as before);
its target becomes `addmm` and its arguments `(b, x, W.t())`.
"""

from __future__ import annotations

import torch

from asyncgraph.graph.ir import Graph, Node, Ref, TensorSpec, Value
from asyncgraph.passes.folding import constant_weights
from asyncgraph.passes.rewrite import rebuild

aten = torch.ops.aten
_CPU = torch.device("cpu")


def lower_linear(graph: Graph) -> tuple[Graph, int]:
    """The graph with every lowerable linear written as `t` + `addmm`, and how many were."""
    weights = set(constant_weights(graph))
    names = {n.name for n in graph.nodes} | {v.name for v in graph.values}
    nodes: list[Node] = []
    new_values: list[Value] = []
    for node in graph.nodes:
        if not _lowerable(node, graph, weights):
            nodes.append(node)
            continue
        x, weight, bias = node.args
        name = _fresh(f"{node.name}_weight_t", names)
        spec = graph.values[weight.id].spec
        assert isinstance(spec, TensorSpec)
        transposed = Value(len(graph.values) + len(new_values), name, spec=TensorSpec(
            spec.dtype, spec.device, spec.shape[::-1], spec.hint[::-1]))
        new_values.append(transposed)
        nodes.append(Node(
            index=-1, name=name, target=aten.t.default, args=(weight,), kwargs={},
            output=transposed.id, stack_trace=node.stack_trace,
        ))
        nodes.append(Node(
            index=-1, name=node.name, target=aten.addmm.default,
            args=(bias, x, Ref(transposed.id)), kwargs={}, output=node.output,
            stack_trace=node.stack_trace,
        ))
    if not new_values:
        return graph, 0
    return rebuild(graph, nodes, new_values=new_values), len(new_values)


def _lowerable(node: Node, graph: Graph, weights: set[int]) -> bool:
    if node.target is not aten.linear.default or node.kwargs or len(node.args) != 3:
        return False
    if node.placement_hint is not None:
        return False
    x, weight, bias = node.args
    if not (isinstance(x, Ref) and isinstance(weight, Ref) and isinstance(bias, Ref)):
        return False
    if weight.id not in weights:
        return False
    return (_rank_on_cpu(graph, x) == 2 and _rank_on_cpu(graph, weight) == 2
            and _rank_on_cpu(graph, bias) == 1)


def _rank_on_cpu(graph: Graph, ref: Ref) -> int | None:
    """The tensor's rank when its spec says it is on the CPU; None otherwise."""
    spec = graph.values[ref.id].spec
    if not isinstance(spec, TensorSpec) or spec.device != _CPU:
        return None
    return len(spec.shape)


def _fresh(name: str, taken: set[str]) -> str:
    """`name`, or `name_<k>` for the first k that no node or value has; marked taken."""
    candidate, k = name, 1
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate
