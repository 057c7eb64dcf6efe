"""The order of side effects: the edges that keep side-effecting nodes in graph order.

A dataflow schedule runs a node once its inputs exist, so two calls with no data edge between
them may run in either order, and adaptive placement changes that order from one execution to
the next. For pure nodes that is the point; for nodes with side effects it changes the result
(two `pop`s of one torchbind queue swap their values). So when a Graph is built, every node is
asked which objects or states it touches (`touches`), and each node that touches a state gets
`Node.after`: the outputs of the earlier nodes it must follow. `Node.inputs()` includes them,
so the plan, the schedules (fused runs, straight lines, worker executions), the stream plan,
segments and constant folding all see them as ordinary dependencies: no execution mode needs
code of its own to respect them.

What touches a state (each touch a write unless said otherwise):
- a torchbind method call (`call_torchbind`, an fx `call_method` on a script object) and any
  op taking a script object: that object;
- an effectful op (`with_effects`, an op registered in torch._higher_order_ops.effects): the
  one ordered-effects state (torch threads one token per effect type through them);
- an op whose schema writes an argument (`Tensor(a!)`, a mutable script object): that value,
  followed through the views and getitems that alias it; every other node reading it is a read;
- a GraphBuilder call declared with `effects=`: the states it names (a string, or a Ref for
  the object that value holds).
Per state: a write follows the last write and every read since; a read follows the last write.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from asyncgraph.graph.refs import Ref, iter_refs


class Node(Protocol):
    """What ordering effects reads of a node (graph/ir.py's Node, which imports this module)."""

    @property
    def index(self) -> int: ...
    @property
    def target(self) -> Any: ...
    @property
    def args(self) -> tuple[Any, ...]: ...
    @property
    def kwargs(self) -> dict[str, Any]: ...
    @property
    def output(self) -> int: ...
    @property
    def effects(self) -> tuple[Any, ...]: ...
    after: tuple[int, ...]  # set here: the outputs of the side effects it must follow

    def data_inputs(self) -> list[int]: ...

ORDERED_EFFECTS = ("effects", "ordered")
"""The state every effectful op touches: torch orders them all by one token (EffectType.ORDERED)."""

Key = tuple[Any, ...]


def _effectful_hops() -> tuple[Any, Any]:
    try:
        from torch._higher_order_ops.effects import with_effects
        from torch._higher_order_ops.torchbind import call_torchbind
    except ImportError:  # pragma: no cover - a torch without them
        return None, None
    return call_torchbind, with_effects


_CALL_TORCHBIND, _WITH_EFFECTS = _effectful_hops()


def _has_effects(op: Any) -> bool:
    try:
        from torch._higher_order_ops.effects import has_effects
    except ImportError:  # pragma: no cover - older torch
        return False
    try:
        return bool(has_effects(op))
    except Exception:  # pragma: no cover - a signature another torch changed
        return False


def _is_script_object(obj: Any) -> bool:
    if isinstance(obj, torch.ScriptObject):
        return True
    return type(obj).__name__ == "FakeScriptObject"


def order_effects(nodes: Sequence[Node]) -> frozenset[int]:
    """Set `after` on every node (see the module docstring); return the nodes that touch a
    written state (they stay out of compiled segments)."""
    roots: dict[int, int] = {}
    touched = [touches(node, roots) for node in nodes]
    written = {key for t in touched for key, write in t if write}
    last_write: dict[Key, int] = {}
    reads: dict[Key, list[int]] = {}
    involved: set[int] = set()
    for node, node_touches in zip(nodes, touched, strict=True):
        data = set(node.data_inputs())
        writes = {k for k, w in node_touches if w}
        deps: set[int] = set()
        for key, write in node_touches:
            if key not in written or (not write and key in writes):
                continue
            involved.add(node.index)
            if key in last_write:
                deps.add(last_write[key])
            if write:
                deps.update(reads.pop(key, ()))
                last_write[key] = node.index
            else:
                reads.setdefault(key, []).append(node.index)
        deps.discard(node.index)
        after = sorted(nodes[d].output for d in deps)
        node.after = tuple(v for v in after if v not in data)
    return frozenset(involved)


def touches(node: Node, roots: dict[int, int]) -> list[tuple[Key, bool]]:
    """(state, is_write) for each state `node` touches; records in `roots` (value id -> the
    value it aliases) the views its output is of."""
    found: list[tuple[Key, bool]] = [(_declared(k, roots), True) for k in node.effects]
    target = node.target
    args = node.args
    if target is _CALL_TORCHBIND and args:
        found.append((_object_key(args[0], roots), True))
    elif target is _WITH_EFFECTS:
        found.append((ORDERED_EFFECTS, True))
        if len(args) > 1:
            found += _schema_touches(args[1], args[2:], node.kwargs, roots, None)
    elif target is operator.getitem and args and isinstance(args[0], Ref):
        roots[node.output] = roots.get(args[0].id, args[0].id)
    elif isinstance(target, torch._ops.OpOverload):
        if _has_effects(target):
            found.append((ORDERED_EFFECTS, True))
        found += _schema_touches(target, args, node.kwargs, roots, node.output)
    elif isinstance(target, torch._ops.HigherOrderOperator) and _has_effects(target):
        found.append((ORDERED_EFFECTS, True))
    elif getattr(target, "method", None) is not None and args and _is_script_object(args[0]):
        found.append((_object_key(args[0], roots), True))  # fx call_method on an object
    for value in _leaves((args, node.kwargs)):
        if _is_script_object(value):
            found.append((_object_key(value, roots), True))
    for ref in iter_refs((args, node.kwargs)):
        found.append((("value", roots.get(ref.id, ref.id)), False))
    return found


def _schema_touches(
    op: Any, args: Sequence[Any], kwargs: dict[str, Any], roots: dict[int, int],
    output: int | None,
) -> list[tuple[Key, bool]]:
    """The writes an op's schema declares (`Tensor(a!)`, a mutable object), and the aliases
    its output is of (a view: `Tensor(a)`), recorded in `roots`."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    found: list[tuple[Key, bool]] = []
    aliased: dict[str, Any] = {}
    for position, formal in enumerate(schema.arguments):
        if position < len(args):
            actual = args[position]
        elif formal.name in kwargs:
            actual = kwargs[formal.name]
        else:
            continue
        info = formal.alias_info
        if isinstance(formal.type, torch._C.ClassType):  # a script object
            found.append((_object_key(actual, roots), True))
        if info is None:
            continue
        for name in info.before_set:
            aliased[name] = actual
        if info.is_write:
            found += [(("value", roots.get(r.id, r.id)), True) for r in iter_refs(actual)]
    if output is not None:
        for ret in schema.returns:
            info = ret.alias_info
            for name in info.before_set if info is not None else ():
                for ref in iter_refs(aliased.get(name)):
                    roots[output] = roots.get(ref.id, ref.id)
    return found


def _object_key(obj: Any, roots: dict[int, int]) -> Key:
    if isinstance(obj, Ref):
        return ("value", roots.get(obj.id, obj.id))
    return ("object", id(obj))


def _declared(key: Any, roots: dict[int, int]) -> Key:
    if isinstance(key, Ref):
        return ("value", roots.get(key.id, key.id))
    return ("declared", key)


def _leaves(obj: Any) -> Iterable[Any]:
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _leaves(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _leaves(item)
    else:
        yield obj
