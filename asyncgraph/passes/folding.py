"""Constant folding: nodes that read only weights run once per weights version, not per call.

Why: exported programs recompute what depends on the weights alone on every call: core-ATen
graphs transpose every linear weight (`permute(W, [1, 0])` before each addmm), quantized
programs dequantize their weights, weight-normalised layers renormalise. nativert's
ConstantFolder unlinks such nodes and evaluates them into its Weights; so does this.

What folds: a CPU or prim node with at least one input, every input a weight (a parameter,
buffer or constant that no execution mutates) or the output of another folded node, whose op
is deterministic (no `nondeterministic_seeded` tag), not mutable, without effects, and without
a placement hint. A node whose output is a graph output does not fold: eager returns a fresh
tensor per call, which the caller may modify. Nodes without inputs (`full`, `arange`) do not
fold for the same reason.

How: `fold_constants` returns the graph without the folded nodes, where each folded value the
rest of the graph reads is a CONSTANT input named `_folded.<node>`, plus a ConstantFolder that
computes those values from a weights mapping. The Executor runs the folder when it is built and
on every `swap_weights` (so a bad swap fails there, not in a later request), on the loop, or on
a worker thread for `aswap_weights` (the loop keeps serving meanwhile); buffer updates from
executions keep the folded values (folded nodes never read a mutated buffer).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from asyncgraph.graph.ir import WEIGHT_KINDS, Graph, Node, OutputKind, iter_refs
from asyncgraph.kernels import KernelKind, OpKernel
from asyncgraph.passes.rewrite import rebuild, substitute

FOLDED_PREFIX = "_folded."


class ConstantFolder:
    """Computes the folded values of a program from its weights (see the module docstring)."""

    def __init__(
        self,
        nodes: Sequence[Node],
        kernels: Sequence[OpKernel],
        weights: Mapping[int, str],
        outputs: Mapping[int, str],
    ) -> None:
        self.nodes = list(nodes)
        self.kernels = list(kernels)
        self.weights = dict(weights)  # value id (in the original graph) -> weight name
        self.outputs = dict(outputs)  # value id (in the original graph) -> folded name

    def __call__(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """The folded values, by name, for these weights."""
        values: dict[int, Any] = {vid: tensors[name] for vid, name in self.weights.items()}
        with torch.no_grad():  # not inference_mode: the values must work outside it too
            for node, kernel in zip(self.nodes, self.kernels, strict=True):
                try:
                    values[node.output] = kernel.fn(
                        *substitute(node.args, values), **substitute(node.kwargs, values)
                    )
                except Exception as exc:
                    exc.add_note(
                        f"while folding node %{node.name} ({node.target_name()}), which "
                        "reads only weights"
                    )
                    raise
        return {name: values[vid] for vid, name in self.outputs.items()}

    def __len__(self) -> int:
        return len(self.nodes)

    def reads_same(self, before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
        """Whether `after` holds the very objects `before` holds for every weight this folder
        reads, so that values folded from one are the values of the other (an asynchronous
        swap checks this after folding on a thread: buffer updates keep it, a swap does not)."""
        return all(before[name] is after[name] for name in self.weights.values())


def fold_constants(
    graph: Graph, kernels: Sequence[OpKernel]
) -> tuple[Graph, list[OpKernel], ConstantFolder | None]:
    """The graph and kernels without the foldable nodes, and their folder (None: none fold)."""
    sig = graph.signature
    weights = constant_weights(graph)
    outputs = {ref.id for o in sig.outputs for ref in iter_refs(o.arg)}
    constant = set(weights)
    folded: list[int] = []
    for node, kernel in zip(graph.nodes, kernels, strict=True):
        reads = node.inputs()
        if (reads and all(v in constant for v in reads) and node.output not in outputs
                and _foldable(node, kernel)):
            folded.append(node.index)
            constant.add(node.output)
    if not folded:
        return graph, list(kernels), None
    is_folded = set(folded)
    kept = [n for n in graph.nodes if n.index not in is_folded]
    read = {v for n in kept for v in n.inputs()}
    new_constants = {graph.nodes[i].output: FOLDED_PREFIX + graph.nodes[i].name
                     for i in folded if graph.nodes[i].output in read}
    folder = ConstantFolder(
        [graph.nodes[i] for i in folded], [kernels[i] for i in folded], weights, new_constants
    )
    return rebuild(graph, kept, new_constants), [kernels[n.index] for n in kept], folder


def constant_weights(graph: Graph) -> dict[int, str]:
    """The weights no execution mutates (value id -> weight name): what folding may read."""
    sig = graph.signature
    mutated = {o.target for o in sig.outputs if o.kind is OutputKind.BUFFER_MUTATION}
    return {s.value: s.target or "" for s in sig.inputs
            if s.kind in WEIGHT_KINDS and s.target not in mutated}


def _foldable(node: Node, kernel: OpKernel) -> bool:
    if node.placement_hint is not None or kernel.kind not in (KernelKind.CPU, KernelKind.PRIM):
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
        return False
    try:
        from torch._higher_order_ops.effects import has_effects
    except ImportError:  # pragma: no cover - older torch
        return True
    return not has_effects(target)
