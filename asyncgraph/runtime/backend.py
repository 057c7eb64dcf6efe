"""The event-loop seam: what the runtime asks of the loop it runs on (asyncio, uvloop or trio).

Why a seam of its own: the runtime needs only a handful of loop operations (call a function on
the loop from a worker thread; call one later in this iteration or after a delay; a one-shot
future a caller awaits; a task for an async kernel; the loop's cancellation type; a shield for
the wait that must outlive a cancellation), and on asyncio those are on the per-execution hot
path, where a wrapper per call would cost (a one-node execution costs ~8 us in all). So a
`Loop` is chosen once per Executor per event loop (`current_loop`):

- on asyncio (uvloop included) it is `AsyncioLoop`, whose methods are the loop's own bound
  methods stored as attributes: `loop.call_soon_threadsafe(...)` through it is the same call
  as before, with no extra frame;
- on trio it is `TrioLoop`, one per `trio.run` (kept in a RunVar), which implements the same
  calls with trio's primitives: the run's token (`run_sync_soon`) for calls from threads and
  for `call_soon`, a parked task (`wait_task_rescheduled` / `reschedule`) for a future, a
  system task in a cancel scope of its own for a task (cancelled through that scope), and a
  shielded cancel scope for `shielded`.

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
import concurrent.futures
import contextlib
import sys
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import trio


class Handle(Protocol):
    """A call scheduled for later (asyncio.TimerHandle / Handle)."""

    def cancel(self) -> None: ...


class FutureLike(Protocol):
    """A one-shot result one task awaits (asyncio.Future's subset the runtime uses)."""

    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def result(self) -> Any: ...
    def exception(self) -> BaseException | None: ...
    def set_result(self, result: Any) -> None: ...
    def set_exception(self, exc: BaseException) -> None: ...
    def cancel(self) -> bool: ...
    def __await__(self) -> Generator[Any, None, Any]: ...


class TaskLike(Protocol):
    """A task running a coroutine (asyncio.Task's subset the runtime uses)."""

    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def result(self) -> Any: ...
    def exception(self) -> BaseException | None: ...
    def cancel(self) -> bool: ...
    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...


class Caller(Protocol):
    """What `Executor.aclose(cancel=True)` cancels for an execution in flight: the calling
    asyncio Task, or on trio the execution's own cancel scope (`ScopeCaller`)."""

    def done(self) -> bool: ...
    def cancel(self) -> Any: ...


class Loop(Protocol):
    """What the runtime asks of an event loop (see the module docstring)."""

    @property
    def name(self) -> str: ...
    @property
    def native(self) -> Any: ...  # what per-loop state is keyed by: the asyncio loop, or self
    @property
    def cancelled_exc(self) -> type[BaseException]: ...
    def call_soon(self, fn: Callable[..., object], /, *args: Any) -> Any: ...
    def call_soon_threadsafe(self, fn: Callable[..., object], /, *args: Any) -> Any: ...
    def call_later(self, delay: float, fn: Callable[..., object], /, *args: Any) -> Handle: ...
    def create_future(self) -> Any: ...
    def create_task(self, coro: Coroutine[Any, Any, Any], /) -> Any: ...
    def shielded(self) -> contextlib.AbstractContextManager[Any]: ...
    def pending_tasks(self) -> list[Any]: ...
    def is_closed(self) -> bool: ...


class AsyncioLoop:
    """asyncio (and uvloop): the loop's own bound methods, so calls cost what they did."""

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
        self.call_soon_threadsafe = loop.call_soon_threadsafe
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


def current_loop() -> Loop:
    """The Loop of the running event loop; RuntimeError when there is none."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        trio_module = sys.modules.get("trio")
        if trio_module is not None and trio_module.lowlevel.in_trio_run():
            return _trio_loop()
        raise RuntimeError(
            "asyncgraph runs on a running asyncio (or uvloop) event loop or in trio.run; "
            "none is running in this thread"
        ) from None
    # Not cached: a table keyed by the loop whose value holds the loop would keep every loop
    # alive; callers keep what they bind (the Executor), and the rest are slow paths.
    return AsyncioLoop(loop)


# -- trio --------------------------------------------------------------------------------------

_TRIO_LOOP: Any = None  # trio.lowlevel.RunVar, made on first use (trio is imported lazily)


def _trio_loop() -> TrioLoop:
    global _TRIO_LOOP
    import trio

    if _TRIO_LOOP is None:
        _TRIO_LOOP = trio.lowlevel.RunVar("asyncgraph_loop")
    found: TrioLoop | None = _TRIO_LOOP.get(None)
    if found is None:
        found = TrioLoop(trio.lowlevel.current_trio_token())
        _TRIO_LOOP.set(found)
    return found


def _guarded(fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    """Run a callback; an error goes to sys.unraisablehook, as asyncio's loop logs one (an
    error escaping a run_sync_soon callback would crash the whole trio run)."""
    try:
        fn(*args)
    except BaseException as exc:
        sys.unraisablehook(_Unraisable(exc, fn))  # type: ignore[arg-type]


class _Unraisable:
    def __init__(self, exc: BaseException, obj: object) -> None:
        self.exc_type = type(exc)
        self.exc_value = exc
        self.exc_traceback = exc.__traceback__
        self.err_msg = "asyncgraph: error in a loop callback"
        self.object = obj


class TrioLoop:
    """The Loop of one trio run (see the module docstring)."""

    name = "trio"

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        import trio

        self._trio = trio
        self._token = token
        self.native = self
        self.cancelled_exc: type[BaseException] = trio.Cancelled
        self._tasks: weakref.WeakSet[TrioTask] = weakref.WeakSet()

    def call_soon_threadsafe(self, fn: Callable[..., object], /, *args: Any) -> None:
        self._token.run_sync_soon(_guarded, fn, args)

    def call_soon(self, fn: Callable[..., object], /, *args: Any) -> None:
        """Run `fn` in the run's next batch, after the tasks runnable now (as asyncio's
        call_soon runs it in the next iteration)."""
        self._token.run_sync_soon(_guarded, fn, args)

    def call_later(
        self, delay: float, fn: Callable[..., object], /, *args: Any
    ) -> TrioTimer:
        return TrioTimer(self, delay, fn, args)

    def create_future(self) -> TrioFuture:
        return TrioFuture()

    def create_task(self, coro: Coroutine[Any, Any, Any], /) -> TrioTask:
        task = TrioTask(self, coro)
        self._tasks.add(task)
        return task

    def shielded(self) -> contextlib.AbstractContextManager[Any]:
        """A cancel scope no outer cancellation reaches: trio cancels a scope's every later
        checkpoint, so a wait that must finish (the frame's units) runs shielded."""
        return self._trio.CancelScope(shield=True)

    def pending_tasks(self) -> list[Any]:
        """The runtime's tasks of this run not done (kernels, batches)."""
        return [t for t in self._tasks if not t.done()]

    def is_closed(self) -> bool:
        try:
            self._token.run_sync_soon(_noop)
        except self._trio.RunFinishedError:
            return True
        return False

    def __repr__(self) -> str:
        return f"<TrioLoop {id(self):#x}>"


def _noop() -> None:
    pass


_PENDING, _DONE, _CANCELLED = 0, 1, 2


class TrioFuture:
    """A one-shot result awaited by one trio task: parks it, `set_result` reschedules it."""

    __slots__ = ("_exception", "_result", "_state", "_waiter")

    def __init__(self) -> None:
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiter: Any = None  # the parked trio task

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> Any:
        if self._state == _CANCELLED:
            raise concurrent.futures.CancelledError()
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> BaseException | None:
        if self._state == _CANCELLED:
            raise concurrent.futures.CancelledError()
        return self._exception

    def set_result(self, result: Any) -> None:
        self._settle(_DONE, result, None)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(_DONE, None, exc)

    def cancel(self) -> bool:
        if self._state != _PENDING:
            return False
        self._settle(_CANCELLED, None, None)
        return True

    def _settle(self, state: int, result: Any, exc: BaseException | None) -> None:
        if self._state != _PENDING:
            raise RuntimeError(f"{self!r} is already done")
        self._state, self._result, self._exception = state, result, exc
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            import outcome
            import trio

            trio.lowlevel.reschedule(waiter, outcome.Value(None))

    async def _wait(self) -> Any:
        import trio

        if self._state == _PENDING:
            self._waiter = trio.lowlevel.current_task()

            def abort(raise_cancel: Any) -> trio.lowlevel.Abort:
                # the waiter leaves: the future is cancelled with it (see the module docstring)
                self._waiter = None
                self._state = _CANCELLED
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
        return self.result()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait().__await__()

    def __repr__(self) -> str:
        return f"<TrioFuture {('pending', 'done', 'cancelled')[self._state]}>"


class TrioTask:
    """A coroutine run as a trio system task in a cancel scope of its own, with asyncio.Task's
    done/cancel/callback interface. Cancelled before its first step, it never runs (as an
    asyncio task); its done-callbacks always run, on the trio thread."""

    __slots__ = ("__weakref__", "_callbacks", "_coro", "_future", "_scope")

    def __init__(self, loop: TrioLoop, coro: Coroutine[Any, Any, Any]) -> None:
        import trio

        self._coro: Coroutine[Any, Any, Any] | None = coro
        self._scope = trio.CancelScope()
        self._future = TrioFuture()
        self._callbacks: list[Callable[[Any], object]] = []
        trio.lowlevel.spawn_system_task(self._main, name=getattr(coro, "__qualname__", None))

    async def _main(self) -> None:
        coro, self._coro = self._coro, None
        assert coro is not None
        future = self._future
        outer: BaseException | None = None
        try:
            if self._scope.cancel_called:  # cancelled before its first step
                coro.close()
                future.cancel()
            else:
                with self._scope:
                    result = await coro
                    future.set_result(result)
                if not future.done():
                    future.cancel()  # the scope caught its cancellation
        except _trio_cancelled() as exc:  # the run is ending: an outer scope cancelled it
            future.cancel()
            outer = exc
        except BaseException as exc:
            future.set_exception(exc)
        for callback in self._callbacks:
            _guarded(callback, (self,))
        self._callbacks.clear()
        if outer is not None:
            raise outer

    def done(self) -> bool:
        return self._future.done()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def result(self) -> Any:
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def cancel(self) -> bool:
        if self.done():
            return False
        self._scope.cancel()
        return True

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        if self.done():
            _trio_loop().call_soon(fn, self)
        else:
            self._callbacks.append(fn)

    def __repr__(self) -> str:
        return f"<TrioTask {self._future!r}>"


class ScopeCaller:
    """An execution's stand-in for its calling task on trio, which has no `task.cancel()`:
    the execution runs inside `scope`, and `cancel()` cancels just that scope (not the
    caller's own scopes around it). The scope catches its own cancellation; when the
    caller's own scope is cancelled too, trio hands the Cancelled to the caller's scope."""

    __slots__ = ("scope",)

    def __init__(self) -> None:
        import trio

        self.scope = trio.CancelScope()

    def done(self) -> bool:
        """Whether there is nothing left to cancel (the scope was cancelled already)."""
        return self.scope.cancel_called

    def cancel(self) -> None:
        self.scope.cancel()

    def __repr__(self) -> str:
        return f"<ScopeCaller cancelled={self.scope.cancel_called}>"


def _trio_cancelled() -> type[BaseException]:
    import trio

    return trio.Cancelled


class TrioTimer:
    """`call_later` on trio: a system task sleeping in a cancel scope `cancel` cancels."""

    __slots__ = ("_scope",)

    def __init__(
        self, loop: TrioLoop, delay: float, fn: Callable[..., object], args: tuple[Any, ...]
    ) -> None:
        import trio

        self._scope = trio.CancelScope()

        async def fire() -> None:
            with self._scope:
                await trio.sleep(delay)
                _guarded(fn, args)

        trio.lowlevel.spawn_system_task(fire, name="asyncgraph timer")

    def cancel(self) -> None:
        self._scope.cancel()
