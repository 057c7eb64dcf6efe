"""The parts of a model's graph JSON that torch would run: node targets, symbolic
expressions, range constraints and guards.

torch's deserializer resolves each node's target to a Python object the executor calls,
`sympify`s every `expr_str` and range constraint, and compiles `guards_code` with `exec`. Each
is checked against an allowlist (operators.py, expressions.py) before torch sees the JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from asyncgraph.errors import ProgramLoadError
from asyncgraph.graph.archive.expressions import is_safe_guard, is_safe_sym_expr
from asyncgraph.graph.archive.operators import is_allowed_target


def check_graph_json(graph: dict[str, Any], fail: Callable[[str], ProgramLoadError]) -> None:
    """Raise `fail(message)` at the first target, expression or guard that is not allowed."""
    for obj in _walk(graph):
        if "target" in obj and "inputs" in obj and "outputs" in obj:
            target = obj["target"]
            if not isinstance(target, str):
                raise fail(f"node {obj.get('name')!r}: target is not a string")
            if not is_allowed_target(target):
                raise fail(
                    f"node {str(obj.get('name'))!r}: target {target!r} is not an operator; "
                    "refusing a program that would call it"
                )
        expr = obj.get("expr_str")
        if expr is not None and (not isinstance(expr, str) or not is_safe_sym_expr(expr)):
            raise fail(
                f"symbolic expression {str(expr)[:120]!r} is not a plain arithmetic "
                "expression over symbols; refusing it (torch would evaluate it)"
            )
    ranges = graph.get("range_constraints", {})
    if not isinstance(ranges, dict):
        raise fail("range_constraints is not a mapping")
    for key in ranges:
        if not is_safe_sym_expr(key):
            raise fail(f"range constraint {key[:120]!r} is not an expression over symbols")
    guards = graph.get("guards_code", [])
    if not isinstance(guards, list):
        raise fail("guards_code is not a list")
    for guard in guards:
        if not isinstance(guard, str) or not is_safe_guard(guard):
            raise fail(
                f"guard {str(guard)[:120]!r} is not a comparison of input sizes and "
                "constants; refusing it (torch would compile it with exec)"
            )


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object inside `obj`, depth first, without recursion (deep JSON is hostile)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
