"""Optional graph passes that live above the runtime, given to it by name.

`ExecutorConfig(script_segments=True)` runs compiled/scripted.py's pass, which needs torch.jit
and the compiled layer; the runtime must not import either. The layer above registers a
loader here (asyncgraph/plugins.py, which `import asyncgraph` runs), and the Executor asks for
the pass by name when its configuration turns it on, so the pass's modules are still imported
only on demand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # `import asyncgraph` registers passes here without importing torch
    from asyncgraph.graph.ir import Graph
    from asyncgraph.runtime.config import ExecutorConfig

# A pass that replaces parts of a graph by delegate nodes, given the executor's configuration
# (what it reads of it is its own business): the new graph and their names.
GraphPass: TypeAlias = "Callable[[Graph, ExecutorConfig], tuple[Graph, list[str]]]"

_PASSES: dict[str, Callable[[], GraphPass]] = {}


def register_pass(name: str, load: Callable[[], GraphPass]) -> None:
    """Register `load()`, which imports and returns the pass `name` (an ExecutorConfig flag)."""
    _PASSES[name] = load


def optional_pass(name: str) -> GraphPass:
    """The pass registered as `name`, imported now."""
    load = _PASSES.get(name)
    if load is None:
        raise RuntimeError(f"ExecutorConfig({name}=True) needs its pass: import asyncgraph")
    return load()
