"""The asyncio backend (uvloop included): the loop's own bound methods, and the shortcuts the
Executor's per-call path takes on an asyncio loop.

`AsyncioLoop`'s methods are the loop's own bound methods stored as attributes, so a call
through the seam is the same call as before, with no extra frame. The shortcuts answer, in
tens of nanoseconds, whether the bound loop runs on this thread, which task calls, and whether
that task has a cancellation pending, by reading asyncio's own state (`_thread_id`,
`_current_tasks`, `_must_cancel`): asyncio's public calls cost several times as much, and
`execute` asks once per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

from asyncgraph.runtime.backends.base import Handle
from asyncgraph.runtime.backends.loop_wake import threadsafe_call

# anyio imports its asyncio backend on first use, which is the first execution's first
# `anyio.lowlevel.checkpoint()` or thread hop: 20-130 ms of imports on the event loop, in the
# first burst of requests a server gets (benchmarks/first_burst.py). Imported here instead, when
# the application imports asyncgraph. A private module: if anyio moves it, the import happens
# on first use again, as before.
with contextlib.suppress(ImportError):
    importlib.import_module("anyio._backends._asyncio")

# An asyncio loop in run_forever() sets `_thread_id` to its thread, and a thread runs one loop
# at a time, so a bound loop whose `_thread_id` is this thread is the running loop. That test
# costs ~50 ns; asyncio.get_running_loop() costs ~150 on Python 3.11 (a getpid() system call
# per call), and execute would pay it twice. Loops without the attribute (uvloop) are asked
# for by `running_loop`; trio has no asyncio loop and takes the ordinary path.
thread_ident = threading.get_ident
# The running asyncio loop, for loops without `_thread_id` (uvloop); None on trio.
running_loop = asyncio.events._get_running_loop
# The current task of a given loop, without asyncio.current_task's checks (3.11: its table).
task_of: Callable[[Any], asyncio.Task[Any] | None] = (
    getattr(asyncio.tasks, "_current_tasks", {}).get
    if sys.version_info < (3, 12)
    else asyncio.current_task
)


def runs_here(native: Any) -> bool:
    """Whether the bound asyncio loop `native` is the one running on this thread: by its
    `_thread_id` on asyncio's loop (~50 ns), by asking for the running loop on uvloop's,
    which has none (0.3 us, where asking for the current task and the running loop apart
    took 0.9). False for None (no loop bound yet) and on trio."""
    return native is not None and (
        getattr(native, "_thread_id", None) == thread_ident() or running_loop() is native
    )


def cancel_pending(task: Any) -> bool:
    """Whether the calling task has a cancellation waiting for its next suspension.

    `execute` used to start with `await asyncio.sleep(0)`, a full loop iteration (about 2 us
    of a 13 us one-node execution), so that a call made while cancelled took no frame. Asking
    the task gives the same answer without the iteration. Fairness does not need the yield:
    inline work shares the loop's slice (LoopBudget), and once the slice is spent the next
    execution waits for the next iteration. Without a task, or with a task type that does not
    say, the answer is yes: the caller then takes the old checkpoint.
    """
    return task is None or bool(getattr(task, "_must_cancel", True))


class AsyncioLoop:
    """asyncio (and uvloop): the loop's own bound methods, so calls cost what they did; on
    asyncio's selector loops, `call_soon_threadsafe` is a LoopWake's, which wakes the loop
    without letting go of the GIL (loop_wake.py)."""

    __slots__ = (
        "__weakref__", "call_later", "call_soon", "call_soon_threadsafe", "create_future",
        "create_task", "native",
    )
    name = "asyncio"
    cancelled_exc: type[BaseException] = asyncio.CancelledError

    call_later: Callable[..., Handle]
    call_soon: Callable[..., Any]
    call_soon_threadsafe: Callable[..., Any]
    create_future: Callable[[], Any]
    create_task: Callable[..., Any]
    native: asyncio.AbstractEventLoop

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.native = loop
        self.call_soon = loop.call_soon
        self.call_soon_threadsafe = threadsafe_call(loop)  # one that keeps the GIL
        self.call_later = loop.call_later
        self.create_future = loop.create_future
        self.create_task = loop.create_task

    def shielded(self) -> contextlib.AbstractContextManager[Any]:
        """asyncio delivers a cancellation once: a loop that catches it is not cancelled
        again, so nothing needs shielding."""
        return contextlib.nullcontext()

    def pending_tasks(self) -> list[Any]:
        """Tasks of the loop not done, but the calling one."""
        current = asyncio.current_task(self.native)
        return [t for t in asyncio.all_tasks(self.native) if t is not current and not t.done()]

    def is_closed(self) -> bool:
        return self.native.is_closed()

    def scope_caller(self) -> None:
        """None: on asyncio the calling task is what a cancellation cancels."""
        return None
