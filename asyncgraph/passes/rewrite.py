"""Graph rewriting for the load-time passes (constant folding, recomposition).

A pass decides which nodes remain and which new ones appear; `rebuild` makes the Graph of
them: it keeps the values they, the signature and the new constant inputs use, renumbers
values and nodes densely, and lets the Graph constructor validate the result as it validates
an imported one. `read_only_as` and `rank_on_cpu` are the questions the weight-rewriting
passes (linear.py, epilogue.py, the compiled segments' build) ask of a graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from asyncgraph.graph.ir import (
    Graph,
    InputKind,
    InputSpec,
    Node,
    OutputSpec,
    Ref,
    TensorSpec,
    Value,
    iter_refs,
)

_CPU = torch.device("cpu")


def rebuild(
    graph: Graph,
    nodes: Sequence[Node],
    constants: Mapping[int, str] | None = None,
    new_values: Sequence[Value] = (),
) -> Graph:
    """The graph of `nodes` (in topological order; each `output` a value id of `graph` or of
    `new_values`, whose producer becomes that node), with `constants` (value id -> name) as
    new CONSTANT inputs. `new_values` are values a pass adds: their ids follow the graph's,
    `len(graph.values)` onwards."""
    constants = constants or {}
    for position, value in enumerate(new_values, len(graph.values)):
        if value.id != position:
            raise ValueError(f"new value %{value.name} has id {value.id}, expected {position}")
    all_values = [*graph.values, *new_values]
    sig = graph.signature
    live: set[int] = {s.value for s in sig.inputs} | set(constants)
    for node in nodes:
        live.add(node.output)
        live.update(node.data_inputs())
        live.update(ref.id for ref in iter_refs(node.effects))
    for out in sig.outputs:
        live.update(ref.id for ref in iter_refs(out.arg))
    ids = {old: new for new, old in enumerate(sorted(live))}
    producer = {node.output: i for i, node in enumerate(nodes)}
    values = [
        dataclasses.replace(v, id=ids[v.id], producer=producer.get(v.id))
        for v in all_values if v.id in ids
    ]
    new_nodes = [
        dataclasses.replace(
            n, index=i, output=ids[n.output],
            args=remap(n.args, ids), kwargs=remap(n.kwargs, ids),
            effects=remap(n.effects, ids), after=(),  # the Graph orders effects anew
        )
        for i, n in enumerate(nodes)
    ]
    inputs = [dataclasses.replace(s, value=ids[s.value]) for s in sig.inputs]
    inputs += [InputSpec(InputKind.CONSTANT, ids[v], name) for v, name in constants.items()]
    signature = dataclasses.replace(
        sig, inputs=tuple(inputs),
        outputs=tuple(OutputSpec(o.kind, remap(o.arg, ids), o.target) for o in sig.outputs),
    )
    return Graph(values, new_nodes, signature)


def remap(obj: Any, ids: Mapping[int, Any]) -> Any:
    """`obj` with every Ref(i) inside replaced by Ref(ids[i])."""
    return substitute(obj, {i: Ref(j) for i, j in ids.items()})


def substitute(obj: Any, values: Mapping[int, Any]) -> Any:
    """`obj` (nested tuples, lists, dicts) with every Ref(i) replaced by values[i]."""
    if isinstance(obj, Ref):
        return values[obj.id]
    if isinstance(obj, tuple):
        return tuple(substitute(x, values) for x in obj)
    if isinstance(obj, list):
        return [substitute(x, values) for x in obj]
    if isinstance(obj, dict):
        return {k: substitute(x, values) for k, x in obj.items()}
    return obj


def read_only_as(nodes: Iterable[Node], positions: Mapping[Any, int]) -> dict[int, bool]:
    """Value id -> whether every read of it by `nodes` is as the whole positional argument
    `positions[target]` of a node of that target (the passes that rewrite a weight for the
    ops reading it ask this)."""
    only: dict[int, bool] = {}
    for node in nodes:
        position = positions.get(node.target)
        for index, arg in enumerate(node.args):
            for ref in iter_refs(arg):
                ok = index == position and isinstance(arg, Ref)
                only[ref.id] = only.get(ref.id, True) and ok
        for value in node.kwargs.values():
            for ref in iter_refs(value):
                only[ref.id] = False
    return only


def rank_on_cpu(graph: Graph, ref: Ref) -> int | None:
    """The tensor's rank when its spec says it is on the CPU; None otherwise."""
    spec = graph.values[ref.id].spec
    if not isinstance(spec, TensorSpec) or spec.device != _CPU:
        return None
    return len(spec.shape)
