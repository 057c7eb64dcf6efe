"""Instruments: what the run loop tells an observer, through one small hook.

The loop (scheduler.py) and the Executor call an instrument for each node they time and for
each execution-level phase (the wait for a frame); they never import an implementation, which
lives in a layer above (asyncgraph/tools/trace.py: TraceRecorder, Chrome trace JSON).
`ExecutorConfig(trace=True)` makes the tracer registered with `register_tracer`, which
asyncgraph/plugins.py (run by `import asyncgraph`) registers.
"""

from __future__ import annotations

import time
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


class UnitObserver:
    """The run loop's one timing hook (units.py's Observer), set on a frame only while its
    execution is profiled or traced: profiling by thread CPU time, which a GIL wait or a
    loaded machine does not inflate (into the frame's NodeTimes: placement.py), tracing by
    wall time (to the Instrument). Timed executions run unfused schedules: one node a unit."""

    __slots__ = ("instrument",)

    def __init__(self, instrument: Instrument | None) -> None:
        self.instrument = instrument

    def start(self) -> tuple[int, int]:
        return time.perf_counter_ns(), time.thread_time_ns()

    def done(self, run: Any, unit: int, started: tuple[int, int], result: Any) -> None:
        node = run.schedule.nodes[unit][0]
        if run.times is not None:
            run.times.add(node, time.thread_time_ns() - started[1])
        if self.instrument is not None:
            self.instrument.node_done(
                run.execution_id, node, started[0], time.perf_counter_ns(), result
            )
