"""Instruments: what the run loop tells an observer, through one small hook.

The loop (scheduler.py) and the Executor call an instrument for each node they time and for
each execution-level phase (the wait for a frame); they never import an implementation, which
lives in a layer above (asyncgraph/tools/trace.py: TraceRecorder, Chrome trace JSON).
`ExecutorConfig(trace=True)` makes the tracer registered with `register_tracer`, which
asyncgraph/plugins.py (run by `import asyncgraph`) registers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # `import asyncgraph` registers the tracer here without importing torch
    from asyncgraph.graph.ir import Graph


class Instrument(Protocol):
    """An observer of executions, called on the threads that run them."""

    def node_done(
        self, execution: int, node: int, start_ns: int, end_ns: int, result: Any
    ) -> None:
        """Node `node` of execution `execution` ran from `start_ns` to `end_ns`
        (time.perf_counter_ns) and returned `result`."""

    def phase(self, execution: int, name: str, start_ns: int, end_ns: int) -> None:
        """An execution-level interval, such as waiting for a frame."""


_TRACER: list[Callable[[Graph], Instrument]] = []


def register_tracer(make: Callable[[Graph], Instrument]) -> None:
    """Make `make(graph)` the instrument of Executors built with `ExecutorConfig(trace=True)`."""
    _TRACER[:] = [make]


def make_tracer(graph: Graph) -> Instrument:
    """The tracing instrument for an Executor of `graph` (ExecutorConfig.trace)."""
    if not _TRACER:
        raise RuntimeError(
            "ExecutorConfig(trace=True) needs a tracer: import asyncgraph"
        )
    return _TRACER[0](graph)
