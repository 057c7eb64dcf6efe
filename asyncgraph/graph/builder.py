"""GraphBuilder: graphs of plain Python callables and async functions.

For non-torch dataflow and for tests (fault-injecting graphs):

    b = GraphBuilder()
    x = b.input("x")
    y = b.call(fetch, x)                 # an async function runs as a task on the loop
    z = b.call(parse, y, placement="inline")
    b.output(z)
    ex = Executor(b.build())
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from torch.utils import _pytree as pytree

from asyncgraph.graph.ir import (
    Graph,
    InputKind,
    InputSpec,
    Node,
    OutputKind,
    OutputSpec,
    Ref,
    Signature,
    Value,
    iter_refs,
)

_PLACEMENTS = ("inline", "worker", "task")


class GraphBuilder:
    """Builds a Graph node by node; values are referred to by the Refs it returns."""

    def __init__(self) -> None:
        self._values: list[Value] = []
        self._nodes: list[Node] = []
        self._inputs: list[InputSpec] = []
        self._outputs: Any = None
        self._names: set[str] = set()

    def input(self, name: str) -> Ref:
        """Declare the next positional input; errors about it call it `name`."""
        ref = self._new_value(name, None)
        self._inputs.append(InputSpec(InputKind.USER_INPUT, ref.id, name))
        return ref

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        name: str | None = None,
        placement: str | None = None,
        effects: Hashable | Sequence[Hashable] | None = None,
        **kwargs: Any,
    ) -> Ref:
        """Add a node calling `fn(*args, **kwargs)`; Refs in the arguments are graph values.

        `placement` overrides where it runs: "inline" (on the loop), "worker" (a thread; the
        default for sync callables) or "task" (async functions always run as tasks).
        `effects` names the state the call changes (a name, a Ref for the object a value
        holds, or a tuple of them): nodes naming one state run in the order they were added
        (asyncgraph/graph/effects.py), which a dataflow schedule does not keep otherwise.
        """
        if placement is not None and placement not in _PLACEMENTS:
            raise ValueError(f"placement must be one of {_PLACEMENTS}, got {placement!r}")
        declared: tuple[Any, ...] = ()
        if effects is not None:
            declared = tuple(effects) if isinstance(effects, (tuple, list)) else (effects,)
        base = str(name or getattr(fn, "__name__", None) or "node")
        unique = base
        k = 1
        while unique in self._names:
            unique = f"{base}_{k}"
            k += 1
        index = len(self._nodes)
        ref = self._new_value(unique, index)
        self._nodes.append(
            Node(index, unique, fn, tuple(args), dict(kwargs), ref.id, placement_hint=placement,
                 effects=declared)
        )
        return ref

    def output(self, outputs: Any) -> None:
        """Set the graph's output: a Ref or any pytree of Refs and constants."""
        self._outputs = outputs

    def build(self) -> Graph:
        """Validate and return the Graph."""
        leaves, out_spec = pytree.tree_flatten(self._outputs)
        outputs = tuple(OutputSpec(OutputKind.USER_OUTPUT, leaf) for leaf in leaves)
        for leaf in leaves:
            list(iter_refs(leaf))
        signature = Signature(tuple(self._inputs), outputs, None, out_spec)
        return Graph(self._values, self._nodes, signature)

    def _new_value(self, name: str, producer: int | None) -> Ref:
        if name in self._names:
            raise ValueError(f"duplicate name {name!r}")
        self._names.add(name)
        ref = Ref(len(self._values))
        self._values.append(Value(ref.id, name, producer, None))
        return ref
