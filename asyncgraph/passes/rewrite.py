"""Graph rewriting for the load-time passes (constant folding, recomposition).

A pass decides which nodes remain and which new ones appear; `rebuild` makes the Graph of
them: it keeps the values they, the signature and the new constant inputs use, renumbers
values and nodes densely, and lets the Graph constructor validate the result as it validates
an imported one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from asyncgraph.graph.ir import Graph, InputKind, InputSpec, Node, OutputSpec, Ref, Value, iter_refs


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
        live.update(node.inputs())
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
