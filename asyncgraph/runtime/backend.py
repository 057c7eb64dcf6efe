"""The event-loop seam: what the runtime asks of the loop it runs on (asyncio, uvloop or trio).

Why a seam of its own: the runtime needs only a handful of loop operations (call a function on
the loop from a worker thread; call one later in this iteration or after a delay; a one-shot
future a caller awaits; a task for an async kernel; the loop's cancellation type; a shield for
the wait that must outlive a cancellation), and on asyncio those are on the per-execution hot
path, where a wrapper per call would cost (a one-node execution costs ~8 us in all). So a
`Loop` is chosen once per Executor per event loop (`current_loop`):

- on asyncio (uvloop included) it is `AsyncioLoop` (backends/asyncio.py), whose methods are
  the loop's own bound methods stored as attributes: `loop.call_soon_threadsafe(...)` through
  it is the same call as before, with no extra frame;
- on trio it is `TrioLoop` (backends/trio.py, imported only then), one per `trio.run` (kept in
  a RunVar), which implements the same calls with trio's primitives: the run's token
  (`run_sync_soon`) for calls from threads and for `call_soon`, a parked task
  (`wait_task_rescheduled` / `reschedule`) for a future, a system task in a cancel scope of its
  own for a task (cancelled through that scope), and a shielded cancel scope for `shielded`.

The seam also gives the Executor's per-call path the asyncio backend's shortcuts (`runs_here`,
`task_of`, `cancel_pending`), so no module of the runtime reads asyncio's internals itself.
The protocols live in backends/base.py; this module re-exports them.

Everything else the runtime awaits (sleeps, checkpoints, threads, events, locks, task groups)
is anyio's, which works on both and is not on the per-execution path. trio is imported only
when a trio run is in progress, so asyncio programs never import it.

Cancellation on trio: `await future` in a cancelled scope raises trio's Cancelled and marks the
future cancelled, as a cancelled asyncio task cancels the future it awaits (the frame pool and
the scheduler rely on that). trio's Cancelled belongs to cancel scopes and cannot be raised at
will, so the runtime never cancels a future someone awaits on trio: where asyncio's owner
cancels it (the batcher giving up a request), the trio owner sets a named asyncgraph error
instead (`future.cancel()` there would wake the waiter with `concurrent.futures.CancelledError`,
asyncio's internals leaking into a trio program). Likewise there is no task to cancel for an
execution: on trio each runs in a cancel scope of its own (`ScopeCaller`) that
`Executor.aclose(cancel=True)` cancels.
"""

from __future__ import annotations

import asyncio
import importlib
import sys

from asyncgraph.runtime.backends.asyncio import (
    AsyncioLoop,
    cancel_pending,
    runs_here,
    task_of,
)
from asyncgraph.runtime.backends.base import (
    Caller,
    FutureLike,
    Handle,
    Loop,
    ScopedCaller,
    TaskLike,
)

__all__ = [
    "Caller", "FutureLike", "Handle", "Loop", "ScopedCaller", "TaskLike", "cancel_pending",
    "current_loop", "runs_here", "task_of",
]


def current_loop() -> Loop:
    """The Loop of the running event loop; RuntimeError when there is none."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        trio_module = sys.modules.get("trio")
        if trio_module is not None and trio_module.lowlevel.in_trio_run():
            return importlib.import_module("asyncgraph.runtime.backends.trio").trio_loop()  # type: ignore[no-any-return]
        raise RuntimeError(
            "asyncgraph runs on a running asyncio (or uvloop) event loop or in trio.run; "
            "none is running in this thread"
        ) from None
    # Not cached: a table keyed by the loop whose value holds the loop would keep every loop
    # alive; callers keep what they bind (the Executor), and the rest are slow paths.
    return AsyncioLoop(loop)
