"""Ref: a reference to a value inside a node's arguments, and the walk that finds them.

Apart from ir.py because graph/effects.py needs them and ir.py needs effects.py (a Graph orders
its side effects when it is built): here they sit below both. ir.py re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to value `id` inside a node's arguments or the graph's outputs."""

    id: int


def iter_refs(obj: Any) -> Iterator[Ref]:
    """Every Ref inside a nested structure of tuples, lists and dicts."""
    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_refs(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_refs(item)
