"""LoopCharges: the GPU path's per-execution fixed work, charged to the event loop's slice.

Why: a replayed execution's GPU work is one launch, so what it costs is host work on the
loop's thread: validation, a frame, `begin`, the launch, the host wait's wake, the outputs,
the caller's return (about 20-30 us each on the no-op backend of benchmarks/gpu_host.py). The
loop's LoopBudget (asyncgraph/runtime/loop_budget.py: the slice inline work on one loop shares,
held per loop) bounds inline kernels, but none of this is a kernel: 64 callers gathered in
one iteration all ran it before a timer or I/O got its turn, and 64 executions whose GPU work
ended together (one drain of the host waiter wakes them all) all went on in the iteration after.

So an execution takes the slice like an inline kernel does, at two points:

- `admits()`, else `await admit()` (Executor._execute, once the execution holds its frame,
  before anything else): it starts only with room left in the slice for one execution's
  fixed work, else in a later iteration. Holding the frame, it is in flight: `aclose` waits
  for it and `aclose(cancel=True)` cancels it, as any other.
- `turn()` (after FrameStreams.finish, once the stream set, and a replay's graph instance,
  are back): it goes on only with room left, else in a later iteration. Where there is room
  it goes ahead of executions waiting to start: it holds a frame, and its caller waits.
- `open()` (FrameStreams.begin) opens the iteration's slice when none is open, so that other
  inline work of the iteration sees it spent sooner.

Those that find no room wait in one FIFO per Executor, and a later iteration wakes as many as
its slice has room for (`_wake`), by the measured cost of one execution's fixed work
(`cost_s`: the time between the starts of two executions a wake let through, smoothed;
measured there only, off the path of an execution that finds room; `FIRST_WAKE` of them
until one was measured), never fewer than one, so nothing waits for ever. Waking every waiter
and letting each look again instead (the budget's own `defer` with a future per waiter, as
this did first) let one slice's worth through per iteration too, but woke all the others
only to queue again: 64 callers cost about a thousand waits where at most two per execution
will do (test_graph_instances.py counts them; the figures are in
design_measurements.md#fixed-work-in-the-loops-slice). The first work of an iteration (no
slice open) always runs.

Loop thread only; without a running loop (a test driving a frame by hand) nothing is charged.
The budget is the loop's own, shared with every Executor on it: the smallest slice asked for
wins (`loop_budget`), `slice_s` (the Executor's `loop_slice_s`) among them, so an Executor
whose executions all replay, which never binds the scheduler's budget, still has a finite
slice. The budget is held by a weak reference to its loop, as the budget table does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from asyncgraph.runtime.backend import current_loop
from asyncgraph.runtime.loop_budget import LoopBudget, loop_budget

FIXED_WORK_S = 50e-6
"""What one execution's fixed host work is taken to cost before any is measured (`cost_s`,
the room it needs in the loop's slice): above the 20-30 us of a replay on the no-op backend,
to leave room for a GPU's CUDA calls, which have not been measured here."""

FIRST_WAKE = 2
"""Executions a wake lets through before any cost was measured: two starts measure one."""

LEAST_COST_S = 5e-6
"""The least one execution's fixed work is taken to cost, whatever is measured."""

SMOOTHING = 0.2
"""The weight of each new measurement of `cost_s` (an exponential moving average)."""


class LoopCharges:
    """One Executor's GPU executions' fixed host work, charged to the running loop's slice."""

    __slots__ = (
        "_budget", "_loop", "_measured", "_started_at", "_started_slice", "_waiting", "_waking",
        "_woken", "cost_s", "deferred", "slice_s",
    )

    def __init__(self, slice_s: float = math.inf) -> None:
        self.slice_s = slice_s
        self._loop: weakref.ref[Any] | None = None
        self._budget: LoopBudget | None = None
        self._waiting: deque[Any] = deque()  # futures of executions waiting for room, FIFO
        self._waking = False  # a `_wake` is deferred to the budget's next iteration
        self._woken = 0  # executions `_wake` let through that have not run yet
        self._started_at = 0.0  # when the last woken execution started, and in which slice
        self._started_slice = -1
        self.cost_s = FIXED_WORK_S  # one execution's fixed work, measured (smoothed)
        self._measured = False
        self.deferred = 0  # executions that waited for a later iteration (admit or turn)

    def budget(self) -> LoopBudget | None:
        """The running loop's budget; None without a running loop."""
        native = _running_native()
        if native is None:
            return None
        if self._loop is not None and self._loop() is native:
            return self._budget
        budget = self._budget = loop_budget(native, self.slice_s)
        self._loop = weakref.ref(native)
        return budget

    def admits(self) -> bool:
        """Whether an execution may start now (taking its room in the slice): the running
        loop's slice has room for its fixed work and no execution waits before it; True
        without a running loop. When False, the execution awaits `admit`."""
        budget = self.budget()
        if budget is None:
            return True
        return not self._waiting and budget.start(self.cost_s) is not None  # opens a slice

    async def admit(self) -> None:
        """Wait for room in a later iteration's slice, behind the executions waiting (the
        execution's `admits` said no)."""
        budget = self.budget()
        if budget is not None:
            await self._wait(budget, starting=True)

    def open(self) -> LoopBudget | None:
        """Take this iteration's slice for an execution's host work (opening one if none
        is open); the budget, for its `turn`, or None without a running loop."""
        budget = self.budget()
        if budget is not None and not budget.is_open:
            budget.deadline()
        return budget

    async def turn(self, budget: LoopBudget) -> None:
        """Return when `budget`'s slice has room for one execution's fixed work (or this is
        the first work of an iteration), else wait for a later iteration. Where there is
        room an execution going on after its GPU work goes ahead of those waiting to start:
        it holds a frame, and its caller waits for its outputs."""
        if budget.start(self.cost_s) is None:
            await self._wait(budget, starting=False)

    async def _wait(self, budget: LoopBudget, starting: bool) -> None:
        """Wait, in arrival order, until a later iteration's `_wake` lets this through
        (`starting`: an execution yet to start, whose start is measured)."""
        self.deferred += 1
        future = current_loop().create_future()
        self._waiting.append(future)
        if not (self._waking or self._woken):  # else the wake or the last woken asks for one
            self._wake_later(budget)
        try:
            await future
        finally:
            if future.cancelled():  # cancelled while it waited: it leaves no entry
                with contextlib.suppress(ValueError):  # `_wake` may have dropped it
                    self._waiting.remove(future)
            else:  # let through by `_wake` (and cancelled since, or not)
                self._through(budget, starting)

    def _started(self, budget: LoopBudget, now: float) -> None:
        """Measure the fixed work of the execution that started before this one in the same
        slice: the time between the two starts."""
        slices = budget.slices
        if slices == self._started_slice:
            spent = min(max(now - self._started_at, LEAST_COST_S), budget.slice_s)
            weight = SMOOTHING if self._measured else 1.0  # the first replaces the prior
            self.cost_s += weight * (spent - self.cost_s)
            self._measured = True
        self._started_at, self._started_slice = now, slices

    def _wake_later(self, budget: LoopBudget) -> None:
        self._waking = True
        budget.defer(self._wake, budget)

    def _wake(self, budget: LoopBudget) -> None:
        """Let through as many waiting executions as one slice has room for (at least one).
        The next wake is asked for by the last of them to run (`_through`): on trio a wake
        deferred now would run before they do, and let a second slice's worth through."""
        self._waking = False
        room = max(1, int(budget.slice_s / self.cost_s)) if self._measured else FIRST_WAKE
        waiting = self._waiting
        while waiting and self._woken < room:
            future = waiting.popleft()
            if not future.done():  # done: cancelled, its task yet to run (`_wait` drops it)
                future.set_result(None)
                self._woken += 1
        if waiting and not self._woken:
            self._wake_later(budget)

    def _through(self, budget: LoopBudget, starting: bool) -> None:
        """One execution `_wake` let through runs now."""
        now = time.perf_counter()
        if not budget.is_open:  # the first of the iteration opens its slice
            budget.deadline()
        if starting:
            self._started(budget, now)
        self._woken -= 1
        if self._waiting and not (self._woken or self._waking):
            self._wake_later(budget)

    def statistics(self) -> LoopChargesStatistics:
        return LoopChargesStatistics(len(self._waiting), self.deferred, self.cost_s)


@dataclass(frozen=True, slots=True)
class LoopChargesStatistics:
    waiting: int  # executions waiting for room now
    deferred: int  # executions that waited for a later iteration so far (to start or go on)
    cost_s: float  # one execution's fixed work, as measured (FIXED_WORK_S until measured)


def _running_native() -> Any | None:
    """The running loop's `native` (what per-loop state is keyed by), or None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        trio = sys.modules.get("trio")
        if trio is not None and trio.lowlevel.in_trio_run():
            return current_loop().native
        return None
