"""Identity removal: nodes that return their input object unchanged leave the graph.

Why: an eval-mode model keeps its dropouts in the exported graph (`dropout(x, p, False)`),
and `at::dropout` returns its input itself when `train` is false or `p` is 0: a call per
execution (Python binding, argument parsing, dispatch) that computes nothing. The
benchmark's tiny BERT has 6 of its 74 nodes like this; every transformer layer has three.

What is removed, exactly: `aten.dropout.default` whose `train` is the constant False or whose
`p` is the constant 0, and whose result is not a graph output. Its readers read its input
instead: the very tensor the call would have returned, so results, aliasing included, are
the same. A graph output keeps its node (the graph's signature is left alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncgraph.graph.ir import Graph, Node, Ref, iter_refs
from asyncgraph.passes.rewrite import rebuild, substitute

aten = torch.ops.aten
_DROPOUT = aten.dropout.default


def drop_identities(graph: Graph) -> tuple[Graph, int]:
    """The graph without its identity nodes, and how many left."""
    outputs = {ref.id for o in graph.signature.outputs for ref in iter_refs(o.arg)}
    forward = _Forwarded()  # a removed node's output -> the Ref it returned
    nodes: list[Node] = []
    for node in graph.nodes:
        args = substitute(node.args, forward)
        kwargs = substitute(node.kwargs, forward)
        returned = _returned_input(node.target, args, kwargs)
        if returned is not None and node.output not in outputs:
            forward[node.output] = returned
            continue
        nodes.append(dataclasses.replace(node, args=args, kwargs=kwargs) if forward else node)
    if not forward:
        return graph, 0
    return rebuild(graph, nodes), len(forward)


class _Forwarded(dict[int, Ref]):
    """Removed outputs to the inputs they were; any other value to itself."""

    def __missing__(self, key: int) -> Ref:
        return Ref(key)


def _returned_input(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Ref | None:
    """The input an identity call returns (dropout with train False or p 0), else None."""
    if target is not _DROPOUT:
        return None
    bound = dict(zip(("input", "p", "train"), args, strict=False)) | kwargs
    x, p, train = bound.get("input"), bound.get("p"), bound.get("train")
    if not isinstance(x, Ref):
        return None
    if train is False or (type(p) in (int, float) and p == 0):
        return x
    return None
