"""White-box views into an Executor, for asyncgraph's own tests.

Some tests must look at what an execution leaves behind or runs on: the idle frames (their
slots cleared, their GPU and capture state), the schedule built for a placement (its units),
the task `execute_flat` takes for the caller, whether the scheduler still holds a frame for a
straight-line retry. These are internal structures whose shape changes with the runtime, so
they are not Executor methods nor statistics: a public accessor would make them part of the
API that applications rely on. Here they are read in one place, typed and documented, instead
of by each test reaching into private attributes; a change of the internals is fixed here.

Read-only but for `take_frame`/`return_frame` (a test fills the pool as executions would).
No stability promise beyond asyncgraph's tests; applications read `Executor.statistics()`,
`placement_statistics()`, `placements()` and the other public statistics instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncgraph.runtime.executor import Executor
from asyncgraph.runtime.frame import ExecutionFrame
from asyncgraph.runtime.plan import Placement
from asyncgraph.runtime.schedule import Schedule

__all__ = [
    "cached_schedule",
    "calling_task",
    "current_placement",
    "frameless_values",
    "idle_frames",
    "return_frame",
    "schedule",
    "take_frame",
]


def idle_frames(ex: Executor) -> tuple[ExecutionFrame, ...]:
    """The frames in the executor's pool that no execution holds now, oldest first."""
    return tuple(ex._pool._idle)


def frameless_values(ex: Executor) -> tuple[Any, ...]:
    """The value slots of the executions that run without a frame (Executor._run_alone),
    cleared after each: anything left in them outlives its execution."""
    return tuple(ex._alone_frame.values)


def take_frame(ex: Executor) -> ExecutionFrame:
    """Take a frame from the executor's pool, as an execution does (tests hold it to fill
    the pool): give it back with `return_frame`. The one exception to read-only here."""
    frame = ex._pool.try_acquire()
    assert frame is not None, "no frame free"
    return frame


def return_frame(ex: Executor, frame: ExecutionFrame) -> None:
    """Give back a frame `take_frame` took (to the oldest waiter first)."""
    ex._pool.release(frame)


def current_placement(ex: Executor) -> tuple[Placement, ...]:
    """The placement tuple chosen most recently (the plan's without adaptive placement): the
    very object the schedule cache and adaptive placement key by (`ex.placements()` gives the
    same placements by node name, as a new mapping)."""
    adaptive = ex._adaptive
    return adaptive.current if adaptive is not None else ex.plan.placement


def schedule(
    ex: Executor, placement: tuple[Placement, ...] | None = None, *, fused: bool = True
) -> Schedule:
    """The executor's schedule for `placement` (default: `current_placement`), built and
    cached by its schedule cache on a miss, as an execution would."""
    chosen = current_placement(ex) if placement is None else placement
    return ex._schedules.get(chosen, fused=fused)


def cached_schedule(
    ex: Executor, placement: tuple[Placement, ...] | None = None, *, fused: bool = True
) -> Schedule | None:
    """The executor's schedule for `placement` (default: `current_placement`) if one was
    built already, else None; never builds one."""
    chosen = current_placement(ex) if placement is None else placement
    return ex._schedules.cached(chosen, fused)


def calling_task(ex: Executor) -> asyncio.Task[Any] | None:
    """The task the executor takes for the caller here (whose pending cancellation it
    honours before taking a frame); None without an asyncio loop (trio)."""
    return ex._calling_task()
