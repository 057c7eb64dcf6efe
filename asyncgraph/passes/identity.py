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
        returned = _returned_input(node, args, kwargs)
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


def _returned_input(node: Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Ref | None:
    """The input an identity call returns (a dropout that draws nothing), else None; `args`
    and `kwargs` are the node's with removed outputs already forwarded."""
    if node.target is not _DROPOUT or not draws_nothing(node, _DROPOUT):
        return None
    x = args[0] if args else kwargs.get("input")
    return x if isinstance(x, Ref) else None


# Arguments that switch a random op's randomness off: dropout(train=False) or with p=0, and
# scaled_dot_product_attention with dropout_p=0 (its default). Eval-mode models are full of them.
_NO_RANDOMNESS: dict[str, Any] = {"train": False, "p": 0, "dropout_p": 0}


def draws_nothing(node: Node, target: torch._ops.OpOverload) -> bool:
    """Whether the call of random op `target` at `node` draws no random numbers: one of its
    arguments turns the randomness off (a compiled call then computes what the plain one does;
    a dropout returns its input)."""
    for i, arg in enumerate(target._schema.arguments):
        if arg.name not in _NO_RANDOMNESS:
            continue
        if i < len(node.args):
            value = node.args[i]
        elif arg.name in node.kwargs:
            value = node.kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            continue
        off = _NO_RANDOMNESS[arg.name]
        if type(value) in (bool, int, float) and value == off and (
                isinstance(off, bool) == isinstance(value, bool)):
            return True
    return False
