"""Self-attention blocks as one ONNX Runtime `Attention` node, for ONNX segments.

Why: `nn.MultiheadAttention` (and so `nn.TransformerEncoderLayer`) reaches the exporter as a
packed input projection, some twenty layout moves (unflatten, unsqueeze, transpose, squeeze,
select, view), `scaled_dot_product_attention`, more moves and the output projection. ONNX
Runtime runs each move as a node of its own, and on small models the nodes' fixed costs are
most of a call: tiny BERT's session spent more time in Reshape, Transpose and Squeeze than in
its GEMMs. ONNX Runtime's `com.microsoft.Attention` does the projection, the heads and the
softmax in one node, and tiny BERT and the encoder ran faster with it at batch 1 and at 32
rows (benchmarks/results/cpu/design_measurements.md#attention-fusion); ONNX Runtime's own
fusions (and onnxscript's) do not match the order torch writes these blocks in.

What: `attention_fused(module, args)` finds each block around a dropout-free, non-causal
`scaled_dot_product_attention` whose query, key and value come, through layout moves only,
from projections (`linear`, or `addmm` over a transposed weight; weights and biases are segment
inputs) of the block's input: one packed projection (nn.MultiheadAttention), or one each
(transformers' BERT, whose three weights are concatenated into one). Its mask must let every
position attend whatever the inputs: none, or one whose value depends on no input's values
and is all True (transformers' `arange(seq) >= 0`) or all zeros. The output goes, through
layout moves only, into one projection. The block, from its input (batch first, or sequence
first) to the last node of the moves after the output projection that has the input's shape,
becomes one call of `asyncgraph::attention_block`: the same math in torch, one `Attention` node
and the output projection in ONNX (`attention_onnx`). Padding masks, causal attention and
cross-attention keep their nodes.

Safety: the match is structural, so the rewritten module is run beside the original on random
inputs of the export's example shapes, and used only if every output agrees; otherwise the
segment is exported as it was. The form made from it is then checked against the plain graph
per signature, as every form is (delegate_support.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

LOG = logging.getLogger("asyncgraph.onnx")
aten = torch.ops.aten

# ops that only move or view values: a block's query, key and value reach its projection
# through these alone
LAYOUT = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.select.int, aten.contiguous.default, aten.clone.default,
    aten.unflatten.int,
})
# the rewritten module against the original: its largest difference, as a share of the
# output's largest value. Random weights make large values that round apart after a few
# layers, while a block matched wrongly (other heads, another layout) is off by about the
# values themselves (benchmarks/results/cpu/design_measurements.md#attention-fusion).
TOLERANCE = 1e-3


@torch.library.custom_op("asyncgraph::attention_block", mutates_args=())
def attention_block(x: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor,
                    in_transposed: bool, out_weight: torch.Tensor, out_bias: torch.Tensor | None,
                    out_transposed: bool, num_heads: int, seq_first: bool,
                    scale: float | None) -> torch.Tensor:
    """Self-attention with a packed input projection and its output projection: `x` is
    (batch, seq, embed), or (seq, batch, embed) when `seq_first`; the result has `x`'s
    layout. A weight is (out, in), as `linear` takes it, or (in, out) when `*_transposed`."""
    if seq_first:
        x = x.transpose(0, 1)
    batch, seq, _ = x.shape
    packed = F.linear(x, in_weight.t() if in_transposed else in_weight, in_bias)
    q, k, v = packed.view(batch, seq, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    heads = F.scaled_dot_product_attention(q, k, v, scale=scale)
    out = F.linear(heads.transpose(1, 2).reshape(batch, seq, -1),
                   out_weight.t() if out_transposed else out_weight, out_bias)
    return out.transpose(0, 1).contiguous() if seq_first else out


@attention_block.register_fake
def _attention_block_shape(x: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor,
                           in_transposed: bool, out_weight: torch.Tensor,
                           out_bias: torch.Tensor | None, out_transposed: bool, num_heads: int,
                           seq_first: bool, scale: float | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_weight.shape[1 if out_transposed else 0]))


def attention_onnx(x: Any, in_weight: Any, in_bias: Any, in_transposed: bool, out_weight: Any,
                   out_bias: Any, out_transposed: bool, num_heads: int, seq_first: bool,
                   scale: float | None) -> Any:
    """The ONNX translation of `attention_block` (an onnxscript trace-only function). The
    weights' Transposes are of constants, which ONNX Runtime folds when it loads the model."""
    import onnxscript
    from onnxscript import opset18 as op

    attention = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "Attention",
                                     _attention_schema())
    if seq_first:
        x = op.Transpose(x, perm=[1, 0, 2])
    extra = {} if scale is None else {"scale": float(scale)}
    heads = attention(
        x, in_weight if in_transposed else op.Transpose(in_weight, perm=[1, 0]), in_bias,
        num_heads=num_heads, **extra)
    out = op.MatMul(heads, out_weight if out_transposed else op.Transpose(out_weight, perm=[1, 0]))
    if out_bias is not None:
        out = op.Add(out, out_bias)
    return op.Transpose(out, perm=[1, 0, 2]) if seq_first else out


def _attention_schema() -> Any:
    """The part of ONNX Runtime's `com.microsoft.Attention` schema this module writes (onnx
    has no schemas of ONNX Runtime's contrib ops, and onnxscript needs one to call an op)."""
    from onnx.defs import OpSchema

    def tensor(name: str) -> Any:
        return OpSchema.FormalParameter(name, "T")

    return OpSchema(
        "Attention", "com.microsoft", 1, inputs=[tensor("input"), tensor("weights"),
                                               tensor("bias")],
        outputs=[tensor("output")], type_constraints=[("T", ["tensor(float)"], "")],
        attributes=[OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
                    OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "", required=False)])


TARGET = torch.ops.asyncgraph.attention_block.default


@dataclass
class _Block:
    """One matched block: its nodes (to remove), its last node (whose users take the new
    call), its input, its input projection's weights and biases (one packed projection, or
    the query's, key's and value's) and the new call's other arguments."""

    nodes: list[torch.fx.Node]
    end: torch.fx.Node
    source: torch.fx.Node
    in_weights: tuple[torch.fx.Node, ...]
    in_biases: tuple[torch.fx.Node, ...]
    in_transposed: bool
    rest: tuple[Any, ...]  # out_weight, out_bias, out_transposed, num_heads, seq_first, scale


class _Probe(ShapeProp):
    """ShapeProp (every node's shape in its meta) that also keeps the values of the SDPA
    masks, to tell a mask that lets every position attend."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.masks = {_options(n).get("attn_mask") for n in module.graph.find_nodes(
            op="call_function", target=aten.scaled_dot_product_attention.default)}
        self.values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.masks:
            self.values[n] = result
        return result


def attention_fused(module: torch.fx.GraphModule,
                    args: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """A copy of `module` whose attention blocks are `attention_block` calls, or `module`
    itself when it has none or the copy's outputs differ from its own on random inputs of the
    shapes of `args`."""
    if not module.graph.find_nodes(op="call_function",
                                   target=aten.scaled_dot_product_attention.default):
        return module
    probe = [_random(a, seed) for seed, a in enumerate(args)]
    fused = torch.fx.GraphModule(module, _copied(module.graph))
    probing = _Probe(fused)
    try:
        expected = probing.propagate(*probe)
    except Exception as exc:  # a module torch cannot run on random values: left alone
        LOG.debug("attention fusion skipped: the segment does not run on random inputs (%s)",
                  exc)
        return module
    blocks = [b for node in fused.graph.find_nodes(
        op="call_function", target=aten.scaled_dot_product_attention.default)
        if (b := _block(node, probing.values)) is not None]
    if not blocks:
        return module
    try:
        _rewrite(fused, blocks)
        actual = fused(*probe)
        same = _same(expected, actual)
    except Exception as exc:
        LOG.debug("attention fusion dropped: the rewritten segment failed (%s)", exc)
        return module
    if not same:
        LOG.debug("attention fusion dropped: the rewritten segment's outputs differ")
        return module
    return fused


def _rewrite(module: torch.fx.GraphModule, blocks: list[_Block]) -> None:
    """Each block of `module` as one `attention_block` call, in place."""
    graph = module.graph
    for block in blocks:
        with graph.inserting_before(block.end):
            weight, bias = _packed(graph, block)
            call = graph.call_function(TARGET, (block.source, weight, bias, block.in_transposed,
                                                *block.rest))
        block.end.replace_all_uses_with(call)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted({n for b in blocks for n in b.nodes}, key=order.__getitem__,
                       reverse=True):
        graph.erase_node(node)
    graph.eliminate_dead_code()
    module.recompile()


def _block(sdpa: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> _Block | None:
    """The block around `sdpa`, or None when it is not one this module rewrites; `values`:
    the probe's values of the SDPA masks."""
    q, k, v = sdpa.args[:3]
    options = _options(sdpa)
    mask = options.get("attn_mask")
    if ((mask is not None and not _allows_all(mask, values))
            or options.get("dropout_p", 0.0) != 0.0 or options.get("is_causal", False)
            or options.get("enable_gqa", False)):
        return None
    heads = _shape(q)
    if heads is None or len(heads) != 4:
        return None
    batch, num_heads, seq, embed = heads[0], heads[1], heads[2], heads[1] * heads[3]
    paths = [_back(n) for n in (q, k, v)]
    projection = _in_projection([p[0] for p in paths], embed)
    forward = _forward(sdpa)
    if projection is None or forward is None:
        return None
    x, weights, biases, in_transposed, projections = projection
    moves, out_projection, (_, out_weight, out_bias, out_transposed), tail = forward
    layout = _source(x, batch, seq, embed)
    out_shape = _shape(out_weight)
    if layout is None or out_shape is None or len(out_shape) != 2:
        return None
    source, seq_first, leading = layout
    wanted = (*(_shape(source) or ())[:-1], out_shape[1 if out_transposed else 0])
    ends = [n for n in (out_projection, *tail) if _shape(n) == wanted]
    if not ends:
        return None
    end = ends[-1]
    nodes = [*leading, *projections, *{n: None for p in paths for n in p[1]}, sdpa, *moves,
             out_projection, *tail[:tail.index(end) + 1 if end in tail else 0]]
    inside = set(nodes)
    if any(u not in inside for n in nodes if n is not end for u in n.users):
        return None
    return _Block(nodes, end, source, weights, biases, in_transposed,
                  (out_weight, out_bias, out_transposed, num_heads, seq_first,
                   options.get("scale")))


def _options(sdpa: torch.fx.Node) -> dict[str, Any]:
    """An SDPA node's arguments after query, key and value, by name."""
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    return {**dict(zip(names, sdpa.args[3:], strict=False)), **sdpa.kwargs}


def _in_projection(sources: list[Any], embed: int) -> tuple[
        Any, tuple[Any, ...], tuple[Any, ...], bool, list[torch.fx.Node]] | None:
    """What the query, key and value come from: one packed projection of (3 * embed) outputs
    (nn.MultiheadAttention), or three of `embed` outputs each over one input (transformers'
    BERT). Its input, weights, biases, whether the weights are (in, out), and its nodes."""
    nodes = list(dict.fromkeys(sources))
    parts = [_projection(n) for n in nodes]
    if len(nodes) not in (1, 3) or any(p is None or p[2] is None for p in parts):
        return None
    inputs = {p[0] for p in parts}  # type: ignore[index]
    transposed = {p[3] for p in parts}  # type: ignore[index]
    outputs = embed * 3 // len(nodes)
    shapes = {_shape(p[1]) for p in parts}  # type: ignore[index]
    if len(inputs) != 1 or len(transposed) != 1 or shapes != {
            (embed, outputs) if transposed == {True} else (outputs, embed)}:
        return None
    return (parts[0][0], tuple(p[1] for p in parts), tuple(p[2] for p in parts),  # type: ignore[index]
            transposed == {True}, nodes)


def _source(x: Any, batch: int, seq: int, embed: int) -> tuple[
        torch.fx.Node, bool, list[torch.fx.Node]] | None:
    """The block's input, whether it is sequence first, and the nodes before the projection
    that the block takes in: `x` batch first (batch, seq, embed) or sequence first; or, when
    `x` is a sequence-first transpose of a batch-first tensor (a batch-first
    nn.MultiheadAttention), that tensor."""
    if not isinstance(x, torch.fx.Node):
        return None
    if (x.target is aten.transpose.int and len(x.users) == 1 and _swaps_first_two(x.args[1:])
            and _shape(x.args[0]) == (batch, seq, embed)):
        return x.args[0], False, [x]  # type: ignore[return-value]
    if _shape(x) == (batch, seq, embed):
        return x, False, []
    if _shape(x) == (seq, batch, embed):
        return x, True, []
    return None


def _allows_all(mask: Any, values: dict[torch.fx.Node, Any]) -> bool:
    """Whether `mask` lets every position attend whatever the inputs: its value does not
    depend on any input's values (shapes may: each signature is checked against the plain
    graph before it is served) and is all True, or all zeros when additive."""
    value = values.get(mask)
    if not isinstance(value, torch.Tensor) or _reads_inputs(mask):
        return False
    if value.dtype == torch.bool:
        return bool(value.all())
    return value.is_floating_point() and not bool(value.any())


def _reads_inputs(node: torch.fx.Node) -> bool:
    """Whether `node`'s value depends on a placeholder's values (its size aside)."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            return True
        if current.target is not aten.sym_size.int:
            pending.extend(current.all_input_nodes)
    return False


def _packed(graph: torch.fx.Graph, block: _Block) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The block's input projection as one weight and one bias: a query's, key's and value's
    are concatenated (weights of the segment, which ONNX Runtime folds into one constant)."""
    if len(block.in_weights) == 1:
        return block.in_weights[0], block.in_biases[0]
    return (graph.call_function(aten.cat.default, (list(block.in_weights),
                                                   1 if block.in_transposed else 0)),
            graph.call_function(aten.cat.default, (list(block.in_biases), 0)))


def _back(node: Any) -> tuple[Any, list[torch.fx.Node]]:
    """The first node before `node` that is not a layout move, and the moves passed."""
    moves: list[torch.fx.Node] = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in LAYOUT:
        moves.append(node)
        node = node.args[0]
    return node, moves


def _forward(sdpa: torch.fx.Node) -> tuple[
        list[torch.fx.Node], torch.fx.Node, tuple[Any, Any, Any, bool], list[torch.fx.Node]] | None:
    """The layout moves after `sdpa`, the projection they lead to (and its `_projection`
    parts), and the moves after it; each node the only user of the one before."""
    moves = _moves_after(sdpa)
    last = moves[-1] if moves else sdpa
    if len(last.users) != 1:
        return None
    (projection,) = last.users
    parts = _projection(projection)
    if parts is None or parts[0] is not last:
        return None
    return moves, projection, parts, _moves_after(projection)


def _moves_after(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The layout moves that follow `node`, each the only user of the one before."""
    moves: list[torch.fx.Node] = []
    while len(node.users) == 1:
        (user,) = node.users
        if not (user.op == "call_function" and user.target in LAYOUT and user.args[0] is node):
            break
        moves.append(user)
        node = user
    return moves


def _projection(node: Any) -> tuple[Any, Any, Any, bool] | None:
    """A projection's input, weight, bias (or None) and whether the weight is (in, out): a
    `linear`, or an `addmm` (compiled/build.py's passes make 2-D linears addmm over the
    transposed weight), whose weight and bias are segment inputs; None for any other node."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.kwargs:
        return None
    args: tuple[Any, ...] = tuple(node.args)
    if node.target is aten.linear.default and len(args) in (2, 3):
        x, weight, bias = (*args, None)[:3]
        transposed = False
    elif node.target is aten.addmm.default and len(args) == 3:
        bias, x, weight = args
        transposed = True
    else:
        return None
    if all(isinstance(a, torch.fx.Node) and a.op == "placeholder"
           for a in (weight, bias) if a is not None):
        return x, weight, bias, transposed
    return None


def _swaps_first_two(dims: Sequence[Any]) -> bool:
    """Whether a 3-D transpose of `dims` swaps dims 0 and 1."""
    return all(isinstance(d, int) for d in dims) and sorted(d % 3 for d in dims) == [0, 1]


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _copied(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    return copy


def _random(arg: torch.Tensor, seed: int) -> torch.Tensor:
    """A value of `arg`'s shape and dtype: random floats, zeros otherwise (always valid
    indices)."""
    if not arg.is_floating_point():
        return torch.zeros_like(arg)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(arg.shape, generator=generator, dtype=arg.dtype)


def _same(expected: Any, actual: Any) -> bool:
    flat_expected, flat_actual = (torch.utils._pytree.tree_leaves(v) for v in (expected, actual))
    return len(flat_expected) == len(flat_actual) and all(
        _close(e, a) if isinstance(e, torch.Tensor) else e == a
        for e, a in zip(flat_expected, flat_actual, strict=True))


def _close(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return False
    if not expected.is_floating_point() or expected.numel() == 0:
        return torch.equal(expected, actual)
    scale = float(expected.abs().max())
    return float((expected - actual).abs().max()) <= TOLERANCE * scale
