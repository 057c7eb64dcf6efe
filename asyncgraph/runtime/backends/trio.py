"""The trio backend: the runtime's loop operations made of trio's primitives.

One `TrioLoop` per `trio.run` (kept in a RunVar): the run's token (`run_sync_soon`) for calls
from threads and for `call_soon`, a parked task (`wait_task_rescheduled` / `reschedule`) for a
future, a system task in a cancel scope of its own for a task (cancelled through that scope),
and a shielded cancel scope for `shielded`. This module is imported only while a trio run is
in progress (runtime/backend.py's `current_loop`), so asyncio programs never import trio.
See runtime/backend.py for how cancellation maps between the two.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import trio


_TRIO_LOOP: Any = None  # trio.lowlevel.RunVar, made on first use (trio is imported lazily)


def trio_loop() -> TrioLoop:
    """The Loop of the running trio run, made on first use in the run."""
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

    def scope_caller(self) -> ScopeCaller:
        """An execution's own cancel scope, what `Executor.aclose(cancel=True)` cancels."""
        return ScopeCaller()

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
            trio_loop().call_soon(fn, self)
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
