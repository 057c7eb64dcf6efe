"""Packed QKV: split a packed in-projection into q, k and v with one view and one permute.

Why: `nn.MultiheadAttention` (so every `nn.TransformerEncoderLayer` and `nn.Transformer`)
projects q, k and v with one linear of width 3E, then exports the split of its output as
`unflatten`, `unsqueeze`, `transpose`, `squeeze`, a `contiguous` copy, three `select`s and, per
head tensor, `view`, `transpose`, `view`: 17 nodes and a copy of the projection between the
linear and `scaled_dot_product_attention`. On a CPU at tiny BERT's size (16 tokens, 128 wide,
4 heads) those took 48 us of Python calls per layer; `view` + `permute` + three `select`s,
with no copy, take 28 us (torch 2.11 and 2.13, one thread).

What is matched, exactly (anything else is left alone), on the CPU: from a projection
L of shape [S, B, 3E],

    c = contiguous(squeeze(transpose(unsqueeze(unflatten(L, -1, [3, E]), 0), 0, -2), -2))
    q_i = view(transpose(view(select(c, 0, i), [S, B*H, D]), 0, 1), [B, H, S, D])

for i = 0, 1, 2 (or core ATen's spelling of the same: `view(L, [S, B, 3, E])` for the
unflatten, `permute` for the transposes, `squeeze.dims`, and `clone` to the contiguous
format), where no intermediate is read outside the pattern or is a graph output, and
each q_i is read only as q, k or v of `scaled_dot_product_attention`. The match becomes

    p = permute(view(L, [S, B, 3, H, D]), [2, 1, 3, 0, 4]);  q_i = select(p, 0, i)

q_i hold the same numbers as before, as views of L with other strides, which attention reads
through (that is why the readers are restricted to it: a `view` of q_i could fail where it
did not). The CPU attention kernels compute the same sums in the same order whatever the
strides (tiny BERT's and the tests' encoders' outputs were bitwise the same on torch 2.11
and 2.13). The new nodes take the names of the
unflatten, the contiguous and the final views (a profile or an error names them as before).
A symbolic batch B (a program exported with a dynamic batch, as batching serves it) is
matched too: the view is then [S, -1, 3, H, D], and the scalar B*H that only the removed
views read goes with them. Left alone: CUDA (not measured), symbolic S, E, H or D.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncgraph.graph.ir import Graph, Node, Ref, ScalarSpec, TensorSpec, Value, iter_refs
from asyncgraph.passes.rewrite import rank_on_cpu, rebuild

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


# A form: (target, the arguments after the first (None: any), [its keywords]). From the
# unflatten to the contiguous copy, one step each: the export's form, then core ATen's.
_Forms = tuple[tuple[Any, ...], ...]
_TO_PACKED: tuple[_Forms, ...] = (
    ((aten.unsqueeze.default, (0,)),),
    ((aten.transpose.int, (0, -2)), (aten.transpose.int, (0, 3)),
     (aten.permute.default, ([3, 1, 2, 0, 4],))),
    ((aten.squeeze.dim, (-2,)), (aten.squeeze.dim, (3,)),
     (aten.squeeze.dims, ([-2],)), (aten.squeeze.dims, ([3],))),
    ((aten.contiguous.default, ()),
     (aten.clone.default, (), {"memory_format": torch.contiguous_format})),
)
_HEAD_TRANSPOSE: _Forms = (
    (aten.transpose.int, (0, 1)), (aten.transpose.int, (1, 0)),
    (aten.permute.default, ([1, 0, 2],)),
)


def split_packed_qkv(graph: Graph) -> tuple[Graph, int]:
    """The graph with every matched split rewritten, and how many were."""
    matcher = _Matcher(graph)
    replaced: dict[int, list[Node]] = {}  # a match's first node -> the nodes replacing it
    removed: set[int] = set()
    new_values: list[Value] = []
    for node in graph.nodes:
        match = matcher.split(node)
        if match is None:
            continue
        split, chain = match
        replaced[node.index] = _replacement(graph, split, new_values)
        removed |= chain
    if not replaced:
        return graph, 0
    removed |= matcher.unread_scalars(removed)
    out: list[Node] = []
    for node in graph.nodes:
        out.extend(replaced.get(node.index, ()))
        if node.index not in removed:
            out.append(node)
    return rebuild(graph, out, new_values=new_values), len(replaced)


@dataclasses.dataclass(frozen=True, slots=True)
class _Split:
    """One match: L, the nodes whose names the replacement takes (the first, an unflatten or
    core ATen's view; the contiguous copy; the three final views: q, k, v in select order)
    and the shape [S, B, 3, H, D] (B an int or a symbol)."""

    projection: Ref
    first: Node
    contiguous: Node
    heads: tuple[Node, Node, Node]
    shape: tuple[Any, ...]


def _replacement(graph: Graph, split: _Split, new_values: list[Value]) -> list[Node]:
    """view(L, [S, B, 3, H, D]) -> permute -> three selects that output the heads' values;
    the view's and the permute's values are appended to `new_values`."""
    s, b, _, h, d = split.shape
    first_id = len(graph.values) + len(new_values)
    spec = graph.values[split.projection.id].spec
    assert isinstance(spec, TensorSpec)
    hint_b = spec.hint[1]
    viewed, viewed_hint = (s, b, 3, h, d), (s, hint_b, 3, h, d)
    permuted, permuted_hint = (3, b, h, s, d), (3, hint_b, h, s, d)
    view_value = Value(first_id, split.first.name,
                       spec=TensorSpec(spec.dtype, spec.device, viewed, viewed_hint))
    permute_value = Value(first_id + 1, split.contiguous.name,
                          spec=TensorSpec(spec.dtype, spec.device, permuted, permuted_hint))
    new_values += [view_value, permute_value]
    nodes = [
        Node(index=-1, name=view_value.name, target=aten.view.default,
             args=(split.projection, [s, b if isinstance(b, int) else -1, 3, h, d]), kwargs={},
             output=view_value.id, stack_trace=split.first.stack_trace),
        Node(index=-1, name=permute_value.name, target=aten.permute.default,
             args=(Ref(view_value.id), [2, 1, 3, 0, 4]), kwargs={}, output=permute_value.id,
             stack_trace=split.contiguous.stack_trace),
    ]
    for i, head in enumerate(split.heads):
        nodes.append(dataclasses.replace(
            head, target=aten.select.int, args=(Ref(permute_value.id), 0, i), kwargs={},
        ))
    return nodes


class _Matcher:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.readers: list[list[Node]] = [[] for _ in graph.values]
        for node in graph.nodes:
            for vid in node.inputs():
                self.readers[vid].append(node)
        self.outputs = {r.id for o in graph.signature.outputs for r in iter_refs(o.arg)}

    def split(self, first: Node) -> tuple[_Split, set[int]] | None:
        """The match starting at `first` (the unflatten, or its core-ATen view) and the
        indices of the nodes it removes; or None."""
        found = self._projection(first)
        if found is None:
            return None
        projection, (s, b, e) = found
        chain = [first]
        node: Node | None = first
        for forms in _TO_PACKED:
            node = node and self._only_reader(node, forms, chain)
        if node is None:
            return None
        contiguous = node
        selects = self.readers[contiguous.output]
        if sorted(self._select_index(n) for n in selects) != [0, 1, 2]:
            return None
        heads: list[Node] = []
        head_shapes: set[tuple[int, int]] = set()
        for select in sorted(selects, key=self._select_index):
            chain.append(select)
            head = self._head(select, s, b, e, chain)
            if head is None:
                return None
            heads.append(head[0])
            head_shapes.add(head[1])
        if len(head_shapes) != 1 or any(n.output in self.outputs for n in chain):
            return None
        if not all(self._read_only_by_attention(head) for head in heads):
            return None
        (h, d), = head_shapes
        split = _Split(projection, first, contiguous, (heads[0], heads[1], heads[2]),
                       (s, b, 3, h, d))
        return split, {n.index for n in chain}

    def _projection(self, first: Node) -> tuple[Ref, tuple[int, Any, int]] | None:
        """L and (S, B, E) when `first` is `unflatten(L, -1, [3, E])` or `view(L, [S, B, 3,
        E])` with L a CPU tensor [S, B, 3E], S and E fixed."""
        if first.kwargs or first.placement_hint is not None or len(first.args) < 2:
            return None
        projection = first.args[0]
        shape = self._shape(projection)
        if shape is None or len(shape) != 3:
            return None
        s, b, width = shape
        if not (isinstance(s, int) and isinstance(width, int) and width % 3 == 0):
            return None
        e = width // 3
        if first.target is aten.unflatten.int:
            ok = first.args[1:] in ((-1, [3, e]), (2, [3, e]))
        elif first.target is aten.view.default:
            size = list(first.args[1])
            ok = len(size) == 4 and size[0] == s and size[2:] == [3, e] and (
                not isinstance(b, int) or size[1] == b)
        else:
            ok = False
        return (projection, (s, b, e)) if ok else None

    def unread_scalars(self, removed: set[int]) -> set[int]:
        """The nodes computing a scalar that only `removed` nodes read: a symbolic view's
        B*H (`sym_size(x, 0) * 4`), unread once its views are gone."""
        unread = set()
        for index in removed:
            for vid in self.graph.nodes[index].inputs():
                value = self.graph.values[vid]
                if (value.producer is not None and isinstance(value.spec, ScalarSpec)
                        and vid not in self.outputs
                        and getattr(self.graph.nodes[value.producer].target, "__module__", "")
                        == "_operator"
                        and all(r.index in removed for r in self.readers[vid])):
                    unread.add(value.producer)
        return unread

    def _head(
        self, select: Node, s: int, b: Any, e: int, chain: list[Node]
    ) -> tuple[Node, tuple[int, int]] | None:
        """view(transpose(view(select, [S, B*H, D]), 0, 1), [B, H, S, D]), and (H, D).

        A symbolic batch B leaves B*H and B unchecked: each view keeps the element count of
        [S, B, E], so with S, H and D fixed they can only be B*H and B.
        """
        first = self._only_reader(select, ((aten.view.default, None),), chain)
        if first is None or len(first.args) != 2 or len(first.args[1]) != 3:
            return None
        s1, bh, d = first.args[1]
        if s1 != s or not isinstance(d, int) or d <= 0 or e % d:
            return None
        h = e // d
        transpose = self._only_reader(first, _HEAD_TRANSPOSE, chain)
        last = transpose and self._only_reader(transpose, ((aten.view.default, None),), chain)
        if last is None or len(last.args) != 2 or len(last.args[1]) != 4:
            return None
        b2, *rest = last.args[1]
        if rest != [h, s, d] or (isinstance(b, int) and (bh, b2) != (b * h, b)):
            return None
        return last, (h, d)

    def _only_reader(self, node: Node, forms: _Forms, chain: list[Node]) -> Node | None:
        """The one node reading `node`'s value, when it reads it once, as its first argument,
        in one of `forms`; added to `chain`."""
        readers = self.readers[node.output]
        if len(readers) != 1:
            return None
        reader = readers[0]
        if (reader.placement_hint is not None or reader.args[:1] != (Ref(node.output),)
                or _reads(reader, node.output) != 1):
            return None
        for target, rest, *kwargs in forms:
            if reader.target is target and reader.kwargs == (kwargs[0] if kwargs else {}) and (
                    rest is None or tuple(reader.args[1:]) == rest):
                chain.append(reader)
                return reader
        return None

    def _select_index(self, node: Node) -> int:
        """i of `select(c, 0, i)` with no placement hint; -1 for anything else."""
        if (node.target is not aten.select.int or node.kwargs or node.placement_hint is not None
                or len(node.args) != 3 or node.args[1] != 0 or not isinstance(node.args[2], int)):
            return -1
        return int(node.args[2])

    def _read_only_by_attention(self, head: Node) -> bool:
        """Whether the head is read, and only as q, k or v of attention."""
        readers = self.readers[head.output]
        return bool(readers) and all(
            r.target is SDPA and _reads(r, head.output) == _reads(r, head.output, r.args[:3])
            for r in readers
        )

    def _shape(self, ref: Any) -> tuple[Any, ...] | None:
        """The shape of a CPU tensor value (ints and symbols); None for anything else."""
        if not isinstance(ref, Ref) or rank_on_cpu(self.graph, ref) is None:
            return None
        spec = self.graph.values[ref.id].spec
        assert isinstance(spec, TensorSpec)
        return tuple(spec.shape)


def _reads(node: Node, value: int, where: Any = None) -> int:
    """How many times `node` reads `value` in `where` (default: all its arguments)."""
    refs = iter_refs((node.args, node.kwargs) if where is None else where)
    return sum(1 for ref in refs if ref.id == value)
