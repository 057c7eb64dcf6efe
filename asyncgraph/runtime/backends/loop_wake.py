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
and the others still run.

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
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


class LoopWake:
    """Calls queued from any thread, run on one asyncio selector loop (see module doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop holds this object through its reader
        # each call with the calling thread's context, as asyncio's own call_soon_threadsafe
        self._calls: deque[tuple[contextvars.Context, Callable[..., object], tuple[Any, ...]]] = (
            deque()
        )
        self._pending = False  # a byte is written and not yet drained
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        weakref.finalize(self, _close, self._read_fd, self._write_fd)
        try:
            loop.add_reader(self._read_fd, self._drain)
        except BaseException:
            _close(self._read_fd, self._write_fd)
            raise
        self._drains = self._calls_run = 0  # counted on the loop's thread only

    def call_soon_threadsafe(self, fn: Callable[..., object], /, *args: Any) -> None:
        """Run `fn(*args)` on the loop soon; from any thread. RuntimeError when the loop is
        closed, as asyncio's own call raises."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            raise RuntimeError("Event loop is closed")
        self._calls.append((contextvars.copy_context(), fn, args))
        if not self._pending:
            self._pending = True
            assert _WRITE is not None  # threadsafe_call makes a LoopWake only with it
            _WRITE(self._write_fd, b"\0", 1)  # a pending byte is enough: EAGAIN is harmless

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 4096)
        self._pending = False  # before counting: a call queued from here on writes again
        self._drains += 1
        calls = self._calls
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
