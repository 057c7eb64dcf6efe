"""Waking an asyncio loop from a worker thread without letting go of the GIL.

Why: asyncio's `call_soon_threadsafe` wakes its loop by writing a byte to the loop's self-pipe
with `socket.send`, which releases the GIL around the system call. A worker that has just
finished a kernel that ran without the GIL (ONNX Runtime, a compiled segment) must then win the
GIL back before it can take its next work item, while the loop holds it to answer callers. On
2 cores with 64 batched callers of tiny BERT that wait was 111 us median per batch (the
worker's whole completion took 16 us once it kept the GIL), with the next batch already queued
and the core idle. Writing the byte through `ctypes.PyDLL`, which calls C without releasing the
GIL, costs a microsecond or two and lets the worker go straight on.

How: one `LoopWake` per loop (`threadsafe_call`, kept in a table that holds loops weakly) owns
a non-blocking pipe whose read end the loop watches (`add_reader`). A thread appends its call
to a deque and writes a byte only when no wake is pending, so a burst of completions costs one
write. The loop's reader drains the pipe and runs the calls queued so far, in order; a call
that raises is reported to the loop's exception handler, as asyncio reports a callback's error,
and the others still run. A KeyboardInterrupt or SystemExit leaves the loop as asyncio lets it
leave, and the calls still queued behind it run on the loop's next iteration, as asyncio's own
`call_soon_threadsafe`'s would: the drain writes a byte for them before it re-raises.

No wake is lost to the unlocked `_pending` flag (the GIL orders the steps: a writer appends its
call, reads the flag, and if clear sets it and then writes; the drain reads the pipe, clears
the flag, then takes the calls queued so far). A writer that read the flag set before the
drain cleared it had appended before the drain took its calls: its call runs in that drain. A
writer that reads it after sees it clear and writes (unless another writer set it after the
clear, and so writes). The flag is set only by a writer that writes next, or by the drain
that writes next, so a set flag always has a byte on its way; two writers that both read it
clear write two bytes, which cost one extra empty drain.

The pipe is closed once, under a lock that every write takes with its closed flag
(`_WakePipe`; an uncontended `threading.Lock` keeps the GIL, and only a burst's one byte takes
it), so a byte never goes to an fd number after it was closed and perhaps reused by a
user's file. It is closed by `close()`; by the first call made once the loop is closed (the
loop's selector, closed with it, watches it no more), which raises RuntimeError as asyncio's
does; or when the LoopWake is collected (no thread is inside a call then: each holds it).
Never at the interpreter's exit (`atexit=False`): daemon workers may still call then, and
the process's end closes the fds anyway. A LoopWake whose `add_reader` fails closes its pipe
itself and registers no finalizer.

Where it applies: asyncio's selector loops where ctypes can load the C library (Linux, macOS).
uvloop already wakes through libuv's `uv_async_send` with the GIL held, the Proactor loop has
no `add_reader`, and trio wakes through its own token: they keep their own
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn


def _gil_holding_write() -> Callable[[int, bytes, int], int] | None:
    """libc's write(2) called with the GIL held (PyDLL), or None where there is no libc."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError, TypeError):  # Windows: no process-wide C library
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write  # type: ignore[no-any-return]


_WRITE = _gil_holding_write()
_WAKES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWake] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True, slots=True)
class LoopWakeStatistics:
    drains: int  # times the loop woke to run queued calls
    calls: int  # calls run: more than drains when a wake carried several
    queued: int  # calls waiting for the next drain


class _WakePipe:
    """The pipe a LoopWake's byte goes through: closed once, and never written once closed
    (the lock every write takes guards the closed flag; see module doc)."""

    __slots__ = ("_lock", "closed", "read_fd", "write_fd")

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        made = False
        try:
            os.set_blocking(self.read_fd, False)
            os.set_blocking(self.write_fd, False)
            made = True
        finally:
            if not made:
                _close(self.read_fd, self.write_fd)
        self.closed = False
        self._lock = threading.Lock()

    def write(self) -> bool:
        """Write the wake byte, keeping the GIL; False when the pipe is closed."""
        with self._lock:  # uncontended: acquired without letting go of the GIL
            if self.closed:
                return False
            assert _WRITE is not None  # threadsafe_call makes a LoopWake only with it
            _WRITE(self.write_fd, b"\0", 1)  # a pending byte is enough: EAGAIN is harmless
            return True

    def close(self) -> None:
        with self._lock:  # after a write in progress, before any later one
            if not self.closed:
                self.closed = True
                _close(self.read_fd, self.write_fd)


class LoopWake:
    """Calls queued from any thread, run on one asyncio selector loop (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop holds this object through its reader
        # each call with the calling thread's context, as asyncio's own call_soon_threadsafe
        self._calls: deque[tuple[contextvars.Context, Callable[..., object], tuple[Any, ...]]] = (
            deque()
        )
        self._pending = False  # a byte is written and not yet drained
        self._pipe = _WakePipe()
        watched = False
        try:
            loop.add_reader(self._pipe.read_fd, self._drain)
            watched = True
        finally:
            if not watched:
                self._pipe.close()
        # only once the pipe is this object's for good, and not at the interpreter's exit,
        # while daemon workers may still write (module doc)
        weakref.finalize(self, self._pipe.close).atexit = False
        self._drains = self._calls_run = 0  # counted on the loop's thread only

    def call_soon_threadsafe(self, fn: Callable[..., object], /, *args: Any) -> None:
        """Run `fn(*args)` on the loop soon; from any thread. RuntimeError when the loop is
        closed, as asyncio's own call raises, or when this LoopWake is."""
        loop = self._loop()
        if loop is None or loop.is_closed() or self._pipe.closed:
            self._refuse(loop)
        self._calls.append((contextvars.copy_context(), fn, args))
        if not self._pending:
            self._pending = True
            if not self._pipe.write():  # closed since the check above: nothing drains it
                self._refuse(loop)

    def _refuse(self, loop: asyncio.AbstractEventLoop | None) -> NoReturn:
        if loop is None or loop.is_closed():
            self.close()  # no selector watches the pipe any more: its fds go now
            raise RuntimeError("Event loop is closed")
        raise RuntimeError(f"the LoopWake of {loop!r} is closed: take threadsafe_call(loop) "
                           "again for a new one")

    def close(self) -> None:
        """Take no more calls and close the pipe; calls still queued are dropped. Call on the
        loop's thread, or once the loop is closed (a call made then closes it too)."""
        loop = self._loop()
        if loop is not None and not loop.is_closed() and not self._pipe.closed:
            loop.remove_reader(self._pipe.read_fd)
            if _WAKES.get(loop) is self:
                del _WAKES[loop]
        self._pipe.close()
        self._calls = deque()  # dropped; a drain in progress keeps the one it takes from

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._pipe.read_fd, 4096)
        self._pending = False  # before counting: a call queued from here on writes again
        self._drains += 1
        calls = self._calls
        try:
            for _ in range(len(calls)):
                context, fn, args = calls.popleft()
                self._calls_run += 1
                try:
                    context.run(fn, *args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    loop = self._loop()
                    if loop is not None:
                        loop.call_exception_handler({
                            "message": f"Exception in callback {fn!r} (asyncgraph LoopWake)",
                            "exception": exc,
                        })
        finally:
            self._wake_for_the_rest()

    def _wake_for_the_rest(self) -> None:
        """The drain is left with calls still queued (an interrupt, an exception handler that
        raised): they run on the loop's next iteration, on a byte written for them. After a
        whole drain nothing is left that wrote no byte of its own: this does nothing."""
        if self._calls and not self._pending:
            self._pending = True
            self._pipe.write()

    def statistics(self) -> LoopWakeStatistics:
        return LoopWakeStatistics(self._drains, self._calls_run, len(self._calls))


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def loop_wake(loop: asyncio.AbstractEventLoop) -> LoopWake | None:
    """The LoopWake of `loop` (made on first use; call on the loop's thread), or None where
    the loop keeps its own `call_soon_threadsafe` (see module doc)."""
    if _WRITE is None or not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
        return None
    wake = _WAKES.get(loop)
    if wake is None and not loop.is_closed():
        wake = _WAKES[loop] = LoopWake(loop)
    return wake


def threadsafe_call(loop: asyncio.AbstractEventLoop) -> Callable[..., Any]:
    """The `call_soon_threadsafe` the runtime uses for `loop` (call on the loop's thread):
    a LoopWake's, which keeps the GIL, on asyncio's selector loops; the loop's own elsewhere."""
    wake = loop_wake(loop)
    return loop.call_soon_threadsafe if wake is None else wake.call_soon_threadsafe
