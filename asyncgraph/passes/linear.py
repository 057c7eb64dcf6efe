"""Linear lowering: linears run on their weight's transpose, folded once into a contiguous copy.

Why: `at::linear(x, W, b)` multiplies by `W.t()`, a view made on every call whose columns are
W's rows: BLAS then reads the weight transposed. The same product on a contiguous copy of
`W.t()` ran 1.4-2.5x faster for the row counts of small requests (torch 2.11 and 2.13, one
thread, 1-16 rows: 512 -> 128 at 16 rows 29.7 against 11.7 us, 256 -> 256 at one row 4.9
against 3.5 us; 1.1-1.2x at 64 rows), and tiny BERT's executions took 0.78x nativert's time
with it against 0.99x. With the transpose a node of its own that reads only a weight,
constant folding makes the copy once per weights version (and again on swap_weights).

What is rewritten, for a linear whose weight `W` is a 2-D CPU weight input (a parameter,
buffer or constant that no execution mutates, as folding requires):
- over a 2-D CPU input with a bias: `addmm(b, x, Wt)`, the op `at::linear` calls for that case,
  without the binding's parsing and the per-call view;
- any other input (3-D, no bias): `linear(x, Wt.t(), b)`, a view of the copy shaped as `W`,
  so that `at::linear` finds its transpose contiguous whatever path it takes;
- a core-ATen graph's own `permute(W, [1, 0])` or `t(W)`, read only as the right operand of
  `addmm` or `mm`, becomes `permute_copy` / `t_copy`: the same copy.
`Wt` is one node per weight however many linears share it: `t_copy(W)`, or `t(W)` (the view,
no copy) with `pretranspose=False`, which also leaves linears of other inputs alone.

What it costs: one more copy of every rewritten weight in memory (the original stays: the
program and `swap_weights` read it), and the copy on every swap. Results agree with the
graph's to float rounding, not bitwise: BLAS blocks the two layouts differently (at one row,
differences of 1e-5 on outputs of order 1; at 16 and 64 rows of these sizes, none). With
`pretranspose=False` the 2-D lowering is bitwise the same as `linear`. Left alone: CUDA (not
measured). A lowered node keeps the linear's name (errors, profiles and traces name it as
before).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncgraph.graph.ir import Graph, Node, Ref, TensorSpec, Value, iter_refs
from asyncgraph.passes.folding import constant_weights
from asyncgraph.passes.rewrite import rank_on_cpu, read_only_as, rebuild

aten = torch.ops.aten
_COPIES: dict[Any, Any] = {
    aten.permute.default: aten.permute_copy.default, aten.t.default: aten.t_copy.default,
}
_RIGHT_OPERAND: dict[Any, int] = {aten.addmm.default: 2, aten.mm.default: 1}  # its position


@dataclasses.dataclass(frozen=True, slots=True)
class LinearLowering:
    """What `lower_linear` made: the graph and its counts (the Executor reports them)."""

    graph: Graph
    lowered: int  # linears rewritten (as addmm, or onto a transposed copy)
    copies: int  # weights transposed into a contiguous copy


def lower_linear(graph: Graph, pretranspose: bool = True) -> LinearLowering:
    """The graph with its linears rewritten (see the module docstring)."""
    rewriter = _Rewriter(graph, pretranspose)
    for node in graph.nodes:
        rewriter.visit(node)
    if not rewriter.new_values and not rewriter.copies:
        return LinearLowering(graph, 0, 0)
    new_graph = rebuild(graph, rewriter.nodes, new_values=rewriter.new_values)
    return LinearLowering(new_graph, rewriter.lowered, rewriter.copies)


class _Rewriter:
    def __init__(self, graph: Graph, pretranspose: bool) -> None:
        self.graph = graph
        self.pretranspose = pretranspose
        self.weights = set(constant_weights(graph))
        self.names = {n.name for n in graph.nodes} | {v.name for v in graph.values}
        self.nodes: list[Node] = []
        self.new_values: list[Value] = []
        self.transposed: dict[int, Ref] = {}  # weight id -> Wt
        self.as_weight: dict[int, Ref] = {}  # weight id -> Wt.t()
        self.lowered = self.copies = 0
        self.right_operands = _right_operands(graph) if pretranspose else {}

    def visit(self, node: Node) -> None:
        args = _linear_args(node, self.graph, self.weights)
        if args is not None:
            x, weight, bias = args
            if bias is not None and rank_on_cpu(self.graph, x) == 2 and (
                    rank_on_cpu(self.graph, bias) == 1):
                args = (bias, x, self._transposed(weight, node))
                node = dataclasses.replace(node, target=aten.addmm.default, args=args)
                self.lowered += 1
            elif self.pretranspose:
                args = (x, self._as_weight(weight, node), *node.args[2:])
                node = dataclasses.replace(node, args=args)
                self.lowered += 1
        elif self._copies_transpose(node):
            node = dataclasses.replace(node, target=_COPIES[node.target])
            self.copies += 1
        self.nodes.append(node)

    def _transposed(self, weight: Ref, user: Node) -> Ref:
        """Wt, made before its first user."""
        ref = self.transposed.get(weight.id)
        if ref is None:
            target = aten.t_copy.default if self.pretranspose else aten.t.default
            spec = self._spec(weight)
            ref = self.transposed[weight.id] = self._new(
                f"{user.name}_weight_t", target, weight, user,
                TensorSpec(spec.dtype, spec.device, spec.shape[::-1], spec.hint[::-1]),
            )
            self.copies += self.pretranspose
        return ref

    def _as_weight(self, weight: Ref, user: Node) -> Ref:
        """Wt.t(): W's shape over the contiguous copy."""
        ref = self.as_weight.get(weight.id)
        if ref is None:
            ref = self.as_weight[weight.id] = self._new(
                f"{user.name}_weight_tt", aten.t.default, self._transposed(weight, user), user,
                self._spec(weight),
            )
        return ref

    def _spec(self, weight: Ref) -> TensorSpec:
        spec = self.graph.values[weight.id].spec
        assert isinstance(spec, TensorSpec)
        return spec

    def _new(self, name: str, target: Any, arg: Ref, user: Node, spec: TensorSpec) -> Ref:
        """A node `target(arg)` before `user`, its value of `spec`."""
        value = Value(len(self.graph.values) + len(self.new_values), _fresh(name, self.names),
                      spec=spec)
        self.new_values.append(value)
        self.nodes.append(Node(
            index=-1, name=value.name, target=target, args=(arg,), kwargs={}, output=value.id,
            stack_trace=user.stack_trace,
        ))
        return Ref(value.id)

    def _copies_transpose(self, node: Node) -> bool:
        """Whether `node` is a weight's transpose read only as a right operand (a copy then)."""
        if node.target not in _COPIES or node.placement_hint is not None:
            return False
        weight = node.args[0]
        if node.target is aten.permute.default and list(node.args[1]) != [1, 0]:
            return False
        return (isinstance(weight, Ref) and weight.id in self.weights
                and rank_on_cpu(self.graph, weight) == 2
                and self.right_operands.get(node.output, False))


def _linear_args(
    node: Node, graph: Graph, weights: set[int]
) -> tuple[Any, Ref, Any] | None:
    """(x, W, bias or None) of a linear over a CPU input and a 2-D CPU weight input."""
    if node.target is not aten.linear.default or node.kwargs or node.placement_hint is not None:
        return None
    if len(node.args) not in (2, 3):
        return None
    x, weight, bias = node.args[0], node.args[1], node.args[2] if len(node.args) == 3 else None
    if not (isinstance(x, Ref) and isinstance(weight, Ref) and weight.id in weights):
        return None
    if rank_on_cpu(graph, weight) != 2 or rank_on_cpu(graph, x) is None:
        return None
    if bias is not None and not isinstance(bias, Ref):
        return None
    return x, weight, bias


def _right_operands(graph: Graph) -> dict[int, bool]:
    """Value id -> whether every read of it is as the right operand of `addmm` or `mm`, and
    it is not a graph output."""
    only = read_only_as(graph.nodes, _RIGHT_OPERAND)
    for out in graph.signature.outputs:
        for ref in iter_refs(out.arg):
            only[ref.id] = False
    return only


def _fresh(name: str, taken: set[str]) -> str:
    """`name`, or `name_<k>` for the first k that no node or value has; marked taken."""
    candidate, k = name, 1
    while candidate in taken:
        candidate, k = f"{name}_{k}", k + 1
    taken.add(candidate)
    return candidate
