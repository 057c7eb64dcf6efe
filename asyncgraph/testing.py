"""Tools for testing code that uses asyncgraph, and asyncgraph itself.

`LeakChecker` asserts, after a test, that every Executor created during it has no frame in
use and no waiter, that no task is left pending on the loop, and that no worker thread
outlives its Executor. Use it as a pytest fixture:

    @pytest.fixture
    async def leak_check():
        async with LeakChecker() as checker:
            yield checker
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncgraph.executor import Executor

_EXECUTORS: weakref.WeakSet[Executor] = weakref.WeakSet()


def track(executor: Executor) -> None:
    """Remember `executor` so a LeakChecker can inspect it (called by Executor.__init__)."""
    _EXECUTORS.add(executor)


class LeakError(AssertionError):
    """Something outlived the test: a frame in use, a waiter, a task, a thread."""


class LeakChecker:
    """Checks that executors, tasks and worker threads are all gone after a block of code."""

    def __init__(self, *, close_executors: bool = True, settle_s: float = 2.0) -> None:
        self.close_executors = close_executors
        self.settle_s = settle_s
        self._executors_before: set[int] = set()
        self._threads_before: set[threading.Thread] = set()

    async def __aenter__(self) -> LeakChecker:
        self._executors_before = {id(e) for e in _EXECUTORS}
        self._threads_before = set(threading.enumerate())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.check()

    async def check(self) -> None:
        """Raise LeakError naming everything that leaked."""
        problems: list[str] = []
        executors = [e for e in list(_EXECUTORS) if id(e) not in self._executors_before]
        for ex in executors:
            stats = ex.statistics()
            if stats.frames.in_use:
                problems.append(f"{ex!r}: {stats.frames.in_use} frame(s) still in use")
            if stats.frames.waiters:
                problems.append(f"{ex!r}: {stats.frames.waiters} waiter(s) for frames")
        if self.close_executors:
            for ex in executors:
                await ex.aclose()
        current = asyncio.current_task()
        for _ in range(10):  # let done-callbacks and cancellations settle
            await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        if pending:
            problems.append(f"{len(pending)} task(s) still pending: {pending[:5]!r}")
        deadline = asyncio.get_running_loop().time() + self.settle_s
        while True:
            stray = [
                t for t in threading.enumerate()
                if t not in self._threads_before and t.name.startswith("asyncgraph")
            ]
            if not stray or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)
        if stray:
            problems.append(f"{len(stray)} worker thread(s) still alive: {[t.name for t in stray]}")
        if problems:
            raise LeakError("leak check failed:\n  " + "\n  ".join(problems))
