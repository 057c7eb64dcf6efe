"""LeakChecker: after a block of code, nothing of any Executor it created may be left over.

Checked: frames still in use, waiters for frames, values left by an execution that ran
without a frame, tasks still pending on the loop, worker threads that outlive their
Executor, event loops closed during the block that the runtime still knows (a LoopBudget
entry outlives its loop only while something holds the loop), and CUDA memory that grew
(when CUDA is initialised). It runs on asyncio, uvloop and trio; on trio the tasks checked
are the runtime's own (async kernels, batches: TrioLoop.pending_tasks), as trio keeps no
list of all tasks.

    async with LeakChecker():
        async with Executor(program) as ex:
            await ex.execute(x)
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import types
import warnings
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel

from asyncgraph.runtime.backend import current_loop
from asyncgraph.runtime.loop_budget import loops_with_budgets
from asyncgraph.runtime.registry import live_executors
from asyncgraph.testing.introspect import frameless_values


class LeakError(AssertionError):
    """Something outlived the test: a frame in use, a waiter, a task, a thread, a closed
    event loop, CUDA memory."""


class LeakChecker:
    """Checks that executors, tasks, worker threads and CUDA memory are all gone after a block.

    Args:
        close_executors: aclose() every Executor created inside the block before checking
            threads, as a test's teardown would.
        settle_s: how long worker threads may take to exit after aclose().
        thread_prefix: names of the threads that must not outlive the block.
        cuda_slack_bytes: CUDA memory allowed to remain allocated (caches of the allocator).
    """

    def __init__(
        self,
        *,
        close_executors: bool = True,
        settle_s: float = 2.0,
        thread_prefix: str = "asyncgraph",
        cuda_slack_bytes: int = 0,
    ) -> None:
        self.close_executors = close_executors
        self.settle_s = settle_s
        self.thread_prefix = thread_prefix
        self.cuda_slack_bytes = cuda_slack_bytes
        # weak references, not ids: an executor live at entry may be freed during the block
        # and a new one made at its address, which a set of ids would then take for it
        self._executors_before: weakref.WeakSet[Any] = weakref.WeakSet()
        self._threads_before: set[threading.Thread] = set()
        self._loops_before: weakref.WeakSet[Any] = weakref.WeakSet()
        self._cuda_before: int | None = None

    async def __aenter__(self) -> LeakChecker:
        self._executors_before = weakref.WeakSet(live_executors())
        self._threads_before = set(threading.enumerate())
        self._loops_before = weakref.WeakSet(loops_with_budgets())
        self._cuda_before = _cuda_allocated()
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
        executors = [e for e in live_executors() if e not in self._executors_before]
        for ex in executors:
            stats = ex.statistics()
            if stats.frames.in_use:
                problems.append(f"{ex!r}: {stats.frames.in_use} frame(s) still in use")
            if stats.frames.waiters:
                problems.append(f"{ex!r}: {stats.frames.waiters} waiter(s) for frames")
            if held := sum(v is not None for v in frameless_values(ex)):
                problems.append(f"{ex!r}: {held} value(s) left by an execution without a frame")
            batching = ex.batching_statistics()
            if batching is not None and (batching.queued or batching.running):
                problems.append(
                    f"{ex!r}: {batching.queued} request(s) queued and {batching.running} "
                    "batch(es) running"
                )
        if self.close_executors:
            for ex in executors:
                await ex.aclose()
        del executors
        for _ in range(10):  # let done-callbacks and cancellations settle
            await anyio.lowlevel.checkpoint()
        pending = current_loop().pending_tasks()
        if pending:
            problems.append(f"{len(pending)} task(s) still pending: {pending[:5]!r}")
        del pending
        stray = await self._stray_threads()
        if stray:
            problems.append(f"{len(stray)} worker thread(s) still alive: {[t.name for t in stray]}")
        loops = await self._closed_loops()
        if loops:
            problems.append(
                f"{len(loops)} closed event loop(s) still alive with a LoopBudget (an Executor, "
                f"frame or budget of the runtime holding its loop?): {loops[:3]!r}"
            )
        del loops
        cuda = _cuda_growth(self._cuda_before, self.cuda_slack_bytes)
        if cuda:
            problems.append(cuda)
        if problems:
            raise LeakError("leak check failed:\n  " + "\n  ".join(problems))

    async def _closed_loops(self) -> list[Any]:
        """Loops that got a budget during the block and were closed, yet are still alive
        `settle_s` later.

        A closed loop usually sits in a reference cycle, so the collector runs first, but only
        when there is such a loop: most blocks never create one, and a full collection costs.
        A thread on its way out may hold one for a moment (a thread pool's idle worker keeps
        its loop until it stops: a block that ran `asyncio.run` itself, on a loaded machine),
        so the check waits as the one for threads does.
        """
        def closed() -> list[Any]:
            return [
                loop for loop in loops_with_budgets()
                if loop.is_closed() and loop not in self._loops_before
            ]

        deadline = time.monotonic() + self.settle_s
        while closed():
            gc.collect()
            loops = closed()
            if not loops or time.monotonic() > deadline:
                return loops
            del loops
            await anyio.sleep(0.01)
        return []

    async def _stray_threads(self) -> list[threading.Thread]:
        deadline = time.monotonic() + self.settle_s
        while True:
            stray = [
                t for t in threading.enumerate()
                if t not in self._threads_before and t.name.startswith(self.thread_prefix)
            ]
            if not stray or time.monotonic() > deadline:
                return stray
            await anyio.sleep(0.01)


def _cuda_allocated() -> int | None:
    """Bytes allocated by the CUDA caching allocator, or None when CUDA is not in use.

    Read the same way before and after the block, once nothing torch caches on its own
    counts (each would otherwise read as a leak of the first test to use it):

    - freed blocks still waiting for streams recorded on them (`record_stream`, which the GPU
      layer uses on cross-stream values and outputs): the allocator keeps them *allocated*
      until it polls their events, which it does only in a later malloc or in `empty_cache`
      (`synchronize_and_free_events`); `synchronize()` alone leaves them counted;
    - cuBLAS (and cuBLASLt) workspaces: allocated through the caching allocator, one per
      (handle, stream) a matmul first ran on, kept for the process, so the first matmul on
      each of an Executor's new streams grows `memory_allocated` by a workspace;
      `torch._C._cuda_clearCublasWorkspaces` drops them (they are re-made on next use).
    """
    import torch

    if not _cuda_in_use():
        return None
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()  # processes the recorded streams' events of freed blocks
    return int(torch.cuda.memory_allocated())


def _cuda_growth(before: int | None, slack: int) -> str | None:
    """What grew since `before`, with what holds the tensors still alive, or None."""
    if not _cuda_in_use():
        return None
    gc.collect()
    if (_cuda_allocated() or 0) - (before or 0) <= slack:
        return None
    with _nothing_frozen():  # a full collection, so only once something seems left
        gc.collect()
        grown = (_cuda_allocated() or 0) - (before or 0)
        if grown <= slack:
            return None
        return f"CUDA memory grew by {grown} bytes; {_cuda_holders()}"


@contextlib.contextmanager
def _nothing_frozen() -> Iterator[None]:
    """Objects frozen by `gc.freeze()` (the test suite freezes each module's survivors, to keep
    its full collections short: tests/conftest.py) are skipped by a collection, so garbage
    that reaches one is never freed, and `gc.get_objects`/`get_referrers` do not see them. The
    CUDA reading and the report of what holds the tensors need every object seen: unfrozen
    for them, frozen again after."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            gc.freeze()


def _cuda_holders(limit: int = 5) -> str:
    """The largest CUDA tensors still alive and what refers to each, so that a CUDA growth
    names its tensors. Some may predate the block: entry keeps no list of tensors, which would
    cost a walk of every object per test."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    with warnings.catch_warnings():  # isinstance on every object warns at torch's deprecated
        warnings.simplefilter("ignore")  # module attributes; the suite makes warnings errors
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda
                   and not isinstance(o, FakeTensor)]  # fake tensors (graph metadata) take none
        tensors.sort(key=lambda t: t.untyped_storage().nbytes(), reverse=True)
        largest = tensors[:limit]
        lines = []
        for t in largest:
            held_by = _holders(t, ignore=(tensors, largest))
            lines.append(f"{tuple(t.shape)} {t.dtype} ({t.untyped_storage().nbytes()} bytes) "
                         f"held by {', '.join(held_by) or 'nothing the collector sees'}")
    return f"{len(tensors)} live CUDA tensor(s), largest first:\n    " + "\n    ".join(lines)


def _holders(obj: Any, ignore: tuple[Any, ...] = ()) -> list[str]:
    """What refers to `obj`, each named: a module's global, a dict's key, a running function
    (its file and line), else the referrer's type. The checker's own frames and the containers
    in `ignore` are left out."""
    named = []
    for holder in gc.get_referrers(obj):
        if any(holder is c for c in ignore) or _is_own_frame(holder):
            continue
        if isinstance(holder, dict):
            key = next((k for k, v in holder.items() if v is obj), "?")
            module = holder.get("__name__") if "__builtins__" in holder else None
            named.append(f"module {module}.{key}" if module else f"dict[{key!r}]")
        elif isinstance(holder, types.FrameType):
            code = holder.f_code
            named.append(f"{code.co_qualname} ({code.co_filename}:{holder.f_lineno})")
        else:
            named.append(type(holder).__qualname__)
    return named


def _is_own_frame(obj: Any) -> bool:
    return isinstance(obj, types.FrameType) and obj.f_code.co_filename == __file__


def _cuda_in_use() -> bool:
    import torch

    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return bool(torch.cuda.is_available() and initialized)
