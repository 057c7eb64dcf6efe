"""Dead code: pure nodes whose values nothing reads leave the graph.

Why: torch.export keeps nodes whose results nothing reads. A Hugging Face BertModel whose
caller reads `last_hidden_state` only keeps its pooler (a linear and a tanh over the first
token), and every transformers export keeps a few unused views of its mask. Run plainly they
cost a call each and change nothing; in a segment they break the delegate: the exporters
(torch.export of the segment, the ONNX translation, AOTInductor) drop them together with the
weights only they read, while the segment still hands those weights over (an ONNX session
refused an initializer its model no longer had: "Failed to find existing initializer ...
pooler_dense_bias"). Segments are planned on the graph without them (compiled/onnx_segments.py;
compiled/build.py does the same to the exported program a package holds).

What goes, exactly: a node whose output no kept node reads (as an argument or an effect
edge) and that is not a graph output, whose target is `operator.getitem`, Python size
arithmetic, or an aten OpOverload that writes none of its arguments, returns something
(an op returning nothing is called for its effect: `_assert_tensor_metadata`), is not in torch
fx's side-effectful set (assertions, profiler ranges), draws no random numbers (a dropped draw
would move the generator for every later one) and touches no state another node writes
(`Graph.effect_nodes`). Removal runs from the last node back, so a chain that only feeds dead
nodes goes with them. The graph's inputs stay as they are: a weight nothing reads any more is
still a weight of the program (swaps name it).
"""

from __future__ import annotations

import operator

import torch
import torch.fx.node

from asyncgraph.graph.ir import Graph, Node, iter_refs
from asyncgraph.passes.identity import draws_nothing
from asyncgraph.passes.rewrite import rebuild

# Python calls without effects that exports put in graphs: tuple indexing and size arithmetic
PURE_PYTHON = (
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
    operator.truediv, operator.mod, operator.neg, operator.pow,
)
# what torch fx keeps whether or not it is read (assertions, profiler ranges, token sinks)
_SIDE_EFFECTFUL = frozenset(getattr(torch.fx.node, "_side_effectful_functions", ()))


def drop_dead_nodes(graph: Graph) -> tuple[Graph, int]:
    """The graph without its dead nodes (the module docstring's), and how many left."""
    read = {ref.id for out in graph.signature.outputs for ref in iter_refs(out.arg)}
    kept: list[Node] = []
    for node in reversed(graph.nodes):
        if node.output not in read and removable(node, graph):
            continue
        kept.append(node)
        read.update(node.inputs())
        read.update(ref.id for ref in iter_refs(node.effects))
    dropped = len(graph.nodes) - len(kept)
    if not dropped:
        return graph, 0
    return rebuild(graph, kept[::-1]), dropped


def removable(node: Node, graph: Graph) -> bool:
    """Whether calling `node` only computes its output: leaving it out, when nothing reads
    that output, changes nothing else."""
    target = node.target
    if any(target is pure for pure in PURE_PYTHON):
        return True
    if not isinstance(target, torch._ops.OpOverload) or node.index in graph.effect_nodes:
        return False
    schema = target._schema
    if schema.is_mutable or not schema.returns:
        return False
    if target in _SIDE_EFFECTFUL:
        return False
    return (torch.Tag.nondeterministic_seeded not in target.tags
            or draws_nothing(node, target))
