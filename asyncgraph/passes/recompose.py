"""Recompose: put decomposed attention back together as one scaled_dot_product_attention.

Why: `run_decompositions()` (the core-ATen form nativert loads) replaces each
`scaled_dot_product_attention` by its math: two scalings, a transpose, four expands and views,
two bmms, a softmax and six ops that zero fully masked rows, about 20 nodes. On a CPU those
take 5-7x the time of the fused kernel they came from (70 vs 10 us per layer of the benchmark
encoder). ONNX Runtime's attention fusion and TensorRT's MHA fusion recompose the same way.

What is matched, exactly (anything else is left alone): from `view(bmm(P, V'), shape)` back to
`q * a`, `permute(k, [0, 1, 3, 2]) * b` and `v`, where P is `_safe_softmax(S, -1)` or the
where/any/eq(-inf) construction that computes it, and S is `view(bmm(q', k'))`; every expand
must keep the shape it is given (no broadcast), q, k and v must be 4-D, the final view must give
SDPA's output shape, and no intermediate may be read outside the pattern or be a graph output.
The match becomes `scaled_dot_product_attention(q, k, v, scale=a * b)`: the same math, including
zeros for rows whose scores are all -inf, summed in another order (results agree to float
rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from asyncgraph.graph.ir import Graph, Node, Ref, TensorSpec, iter_refs
from asyncgraph.passes.rewrite import rebuild

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def recompose_attention(graph: Graph) -> tuple[Graph, int]:
    """The graph with every matched attention recomposed, and how many were."""
    matcher = _Matcher(graph)
    replaced: dict[int, Node] = {}  # index of the pattern's last node -> the SDPA node
    removed: set[int] = set()
    for node in graph.nodes:
        match = matcher.attention(node)
        if match is not None and not (match.nodes & removed):
            replaced[node.index] = match.sdpa
            removed |= match.nodes
    if not replaced:
        return graph, 0
    nodes = [replaced.get(n.index, n) for n in graph.nodes
             if n.index in replaced or n.index not in removed]
    return rebuild(graph, nodes), len(replaced)


class _Match:
    __slots__ = ("nodes", "sdpa")

    def __init__(self, nodes: set[int], sdpa: Node) -> None:
        self.nodes = nodes
        self.sdpa = sdpa


class _Matcher:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.readers: list[set[int]] = [set() for _ in graph.values]
        for node in graph.nodes:
            for vid in node.inputs():
                self.readers[vid].add(node.index)
        self.outputs = {r.id for o in graph.signature.outputs for r in iter_refs(o.arg)}
        self.names = {n.name for n in graph.nodes}

    def attention(self, out: Node) -> _Match | None:
        """The match ending at `out` (the view after the second bmm), or None."""
        seen: set[int] = set()
        p = self._op(out, aten.view.default, seen)
        b1 = p and self._arg(p, 0, aten.bmm.default, seen)
        v12 = b1 and self._arg(b1, 0, aten.view.default, seen)
        v13 = b1 and self._arg(b1, 1, aten.view.default, seen)
        e2 = v12 and self._expand(v12, seen)
        e3 = v13 and self._expand(v13, seen)
        if e2 is None or e3 is None:
            return None
        scores = self._safe_softmax(e2.args[0], seen)
        if scores is None:
            return None
        v11 = self._producer(scores, aten.view.default, seen)
        bmm = v11 and self._arg(v11, 0, aten.bmm.default, seen)
        v9 = bmm and self._arg(bmm, 0, aten.view.default, seen)
        v10 = bmm and self._arg(bmm, 1, aten.view.default, seen)
        e = v9 and self._expand(v9, seen)
        e1 = v10 and self._expand(v10, seen)
        mq = e and self._arg(e, 0, aten.mul.Scalar, seen)
        mk = e1 and self._arg(e1, 0, aten.mul.Scalar, seen)
        pk = mk and self._arg(mk, 0, aten.permute.default, seen)
        if mq is None or mk is None or pk is None or list(pk.args[1]) not in ([0, 1, 3, 2],
                                                                            [0, 1, -1, -2]):
            return None
        q, k, v = mq.args[0], pk.args[0], e3.args[0]
        a, b = mq.args[1], mk.args[1]
        if not (all(self._rank(x) == 4 for x in (q, k, v))
                and all(isinstance(f, (int, float)) and math.isfinite(f) for f in (a, b))
                and self._is_attention_output(out, q, v)):
            return None
        inner = seen - {out.index}
        if any(self.graph.nodes[i].output in self.outputs for i in inner):
            return None
        for i in inner:  # nothing outside the pattern may read an intermediate
            if not self.readers[self.graph.nodes[i].output] <= seen:
                return None
        name = f"{out.name}_sdpa"
        sdpa = Node(
            index=out.index, name=name if name not in self.names else out.name, target=SDPA,
            args=(q, k, v), kwargs={"scale": float(a * b)}, output=out.output,
            stack_trace=out.stack_trace,
        )
        return _Match(seen, sdpa)

    # -- pieces ---------------------------------------------------------------------------

    def _safe_softmax(self, ref: Any, seen: set[int]) -> Ref | None:
        """The scores S of `_safe_softmax(S, -1)`, or of its where/any/eq(-inf) expansion."""
        safe = self._producer(ref, aten._safe_softmax.default, seen)
        if safe is not None:
            plain = len(safe.args) == 2 and safe.kwargs.get("dtype") is None
            return safe.args[0] if plain and self._last_dim(safe.args[1:], safe.args[0]) else None
        where = self._producer(ref, aten.where.self, seen)
        if where is None:
            return None
        not_any, zeros, soft = where.args
        sm = self._producer(soft, aten._softmax.default, seen)
        full = self._producer(zeros, aten.full_like.default, seen)
        ln1 = self._producer(not_any, aten.logical_not.default, seen)
        any_ = ln1 and self._arg(ln1, 0, aten.any.dim, seen)
        ln = any_ and self._arg(any_, 0, aten.logical_not.default, seen)
        eq = ln and self._arg(ln, 0, aten.eq.Scalar, seen)
        if sm is None or full is None or eq is None or any_ is None:
            return None
        scores = sm.args[0]
        if not (self._last_dim(sm.args[1:2], scores) and sm.args[2] is False
                and full.args[0] == soft and full.args[1] == 0
                and eq.args[0] == scores and eq.args[1] == -math.inf
                and self._last_dim(any_.args[1:2], scores) and any_.args[2] is True):
            return None
        return scores  # type: ignore[no-any-return]

    def _is_attention_output(self, out: Node, q: Any, v: Any) -> bool:
        """Whether the final view gives SDPA's shape, [*q.shape[:-1], v.shape[-1]]."""
        spec, qs, vs = self._spec(Ref(out.output)), self._spec(q), self._spec(v)
        if spec is None or qs is None or vs is None:
            return False
        return tuple(spec.shape) == (*qs.shape[:-1], vs.shape[-1])

    def _expand(self, view: Node, seen: set[int]) -> Node | None:
        """The expand feeding `view`, when it keeps its input's shape (no broadcast)."""
        expand = self._arg(view, 0, aten.expand.default, seen)
        if expand is None:
            return None
        before, after = self._spec(expand.args[0]), self._spec(Ref(expand.output))
        if before is None or after is None or tuple(before.shape) != tuple(after.shape):
            return None
        return expand

    def _arg(self, node: Node, i: int, target: Any, seen: set[int]) -> Node | None:
        return self._producer(node.args[i], target, seen) if len(node.args) > i else None

    def _producer(self, ref: Any, target: Any, seen: set[int]) -> Node | None:
        if not isinstance(ref, Ref):
            return None
        index = self.graph.values[ref.id].producer
        if index is None:
            return None
        return self._op(self.graph.nodes[index], target, seen)

    @staticmethod
    def _op(node: Node, target: Any, seen: set[int]) -> Node | None:
        if node.target is not target:
            return None
        seen.add(node.index)
        return node

    def _spec(self, ref: Any) -> TensorSpec | None:
        spec = self.graph.values[ref.id].spec if isinstance(ref, Ref) else None
        return spec if isinstance(spec, TensorSpec) else None

    def _rank(self, ref: Any) -> int:
        spec = self._spec(ref)
        return len(spec.shape) if spec is not None else -1

    def _last_dim(self, dims: Sequence[Any], ref: Any) -> bool:
        return len(dims) == 1 and dims[0] in (-1, self._rank(ref) - 1)
