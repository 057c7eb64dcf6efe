"""LoopState: what the executions of one Executor share on their event loop.

The dataflow (scheduler.py) and the straight line (straight.py) both run units in the loop's
shared slice and hand whole executions or units to worker threads. They share one view of
the loop: which loop it is and its slice budget (LoopBudget), how many executions are in
flight and how many straight lines run on workers, and how much of the loop's time goes to
kernels. Adaptive placement reads the last two as `loaded`.
"""

from __future__ import annotations

from asyncgraph.runtime.backend import Loop, current_loop
from asyncgraph.runtime.loop_budget import LoopBudget, loop_budget


class LoopState:
    """The loop, its slice budget and its load, for one Executor's executions."""

    __slots__ = (
        "_window_busy",
        "_window_start",
        "budget",
        "busy",
        "lines_next",
        "lines_on_workers",
        "loop",
        "running",
        "slice_s",
    )

    def __init__(self, slice_s: float) -> None:
        self.loop: Loop | None = None  # bound by the Executor (backend.py), or on first run
        self.budget: LoopBudget | None = None  # the loop's, once the loop is known
        self.slice_s = slice_s
        self.running = 0  # executions between start and finish (the dataflow's run)
        self.lines_on_workers = 0  # straight lines on worker threads now (queued or running)
        self.lines_next = 0  # straight lines waiting for the loop's next iteration (LINE_NEXT)
        self.busy = 0.0  # the fraction of the last 20 ms window the loop spent in kernels
        self._window_start = 0.0
        self._window_busy = 0.0

    def bind(self) -> LoopBudget:
        """Bind the running loop (when the Executor has not) and its shared budget."""
        loop = self.loop
        if loop is None:
            loop = self.loop = current_loop()
        if self.budget is None:
            self.budget = loop_budget(loop.native, self.slice_s)
        return self.budget

    def account(self, start: float, end: float) -> None:
        """Track the fraction of wall time the loop spends in kernels, per 20 ms window."""
        span = end - self._window_start
        if span > 0.02:
            self.busy = self._window_busy / span
            self._window_start = end
            self._window_busy = 0.0
        self._window_busy += end - start

    @property
    def loaded(self) -> bool:
        """Whether executions overlap and the loop spends over half its time in kernels, or
        a straight line runs on a worker (the loop is then idle, the CPUs are not): then
        adaptive placement also sends heavy nodes of the serial spine to workers, where they
        overlap other executions' work (light nodes stay on the loop: they hold the GIL),
        or keeps a line that leaves whole for a worker inline (straight.py)."""
        return self.running > 0 and (self.busy > 0.5 or self.lines_on_workers > 0)
