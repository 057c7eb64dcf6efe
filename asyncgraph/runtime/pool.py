"""FramePool: a bounded, async, first-come-first-served pool of execution frames.

It replaces nativert's semaphore plus frame queues. At most `max_frames` frames exist. A caller
that finds none free awaits one; a released frame is handed straight to the oldest waiter, so
nobody barges ahead. A waiter cancelled after a frame was handed to it (the release-then-cancel
race of anyio #398) passes the frame on, so no frame is ever leaked or skipped. The waiting is
gate.py's HandOffQueue, which the server's admission gate shares.

At most `max_waiters` callers wait; the next gets OverloadedError at once instead of joining an
unbounded queue, each entry of which pins the caller's inputs.

Idle frames are freed down to `min_frames` once they have been idle for `cleanup_interval_s`
(nativert's two-generation scheme, with timestamps instead of generations).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from asyncgraph.errors import ExecutorClosedError, OverloadedError
from asyncgraph.runtime.backend import Handle, current_loop
from asyncgraph.runtime.config import DEFAULT_MAX_FRAME_WAITERS
from asyncgraph.runtime.frame import ExecutionFrame
from asyncgraph.runtime.gate import HandOffQueue


@dataclass(frozen=True, slots=True)
class FramePoolStatistics:
    """A snapshot of the pool: frames total, in use, idle, waiters and lifetime counters
    (`refused`: acquisitions that found max_waiters waiting and got OverloadedError)."""

    max_frames: int
    total: int
    in_use: int
    idle: int
    waiters: int
    created: int
    freed: int
    high_water: int
    max_waiters: int = 0
    refused: int = 0


class FramePool:
    """Bounded pool of ExecutionFrames with FIFO waiters (see the module docstring)."""

    def __init__(
        self,
        factory: Callable[[int], ExecutionFrame],
        max_frames: int,
        min_frames: int = 1,
        cleanup_interval_s: float = 600.0,
        max_waiters: int = DEFAULT_MAX_FRAME_WAITERS,
    ) -> None:
        self._factory = factory
        self._max = max_frames
        self._max_waiters = max_waiters
        self._min = min_frames
        self._interval = cleanup_interval_s
        self._idle: list[ExecutionFrame] = []
        self._gate: HandOffQueue[ExecutionFrame] = HandOffQueue()
        self._waiters = self._gate.queue  # read only: emptiness on the fast path, no call
        self._in_use = 0
        self._created = 0
        self._freed = 0
        self._high_water = 0
        self._refused = 0
        self._closed = False
        self._timer: Handle | None = None
        self._drained: anyio.Event | None = None

    @property
    def total(self) -> int:
        return self._in_use + len(self._idle)

    def try_acquire(self) -> ExecutionFrame | None:
        """A frame at once, or None when the caller must `await acquire()` (all in use, or
        others already wait: first come, first served). The executor's path when frames are
        free, which costs no coroutine."""
        if self._closed:
            raise ExecutorClosedError("the executor is closed")
        if not self._waiters:
            idle = self._idle
            if idle:
                self._in_use += 1  # never above the high water: a frame was in use before
                return idle.pop()
            if self.total < self._max:
                self._created += 1
                return self._take(self._factory(self._created))
        return None

    def widen(self, max_frames: int) -> None:
        """Raise the bound to `max_frames` (never lowers it); the new frames are made on
        demand, as the first ones were."""
        self._max = max(self._max, max_frames)

    def has_free(self) -> bool:
        """Whether `try_acquire` would give a frame now: one is idle or may be made, and
        nobody waits. An execution that runs without a frame (straight.py: run_alone) runs
        only then, so it never exceeds max_frames nor passes a waiter."""
        return not (self._closed or self._waiters) and (bool(self._idle) or self.total < self._max)

    async def acquire(self) -> ExecutionFrame:
        """Take a frame, awaiting one (first come, first served) when all are in use."""
        frame = self.try_acquire()
        if frame is not None:
            return frame
        if len(self._waiters) >= self._max_waiters:
            self._refused += 1
            raise OverloadedError(
                f"all {self._max} frames are in use and {len(self._waiters)} executions already "
                f"wait for one (ExecutorConfig.max_frame_waiters={self._max_waiters}); raise "
                "max_frame_waiters or max_concurrent_executions, or shed load before calling",
                bound="ExecutorConfig.max_frame_waiters", limit=self._max_waiters,
            )
        return await self._gate.wait(self.release)  # handed, then cancelled: passed on

    def release(self, frame: ExecutionFrame) -> None:
        """Return a frame whose execution is over (no thread or task can touch it)."""
        frame.clear()
        if self._waiters and self._gate.hand_over(frame):
            return  # stays in use, now owned by the waiter
        self._in_use -= 1
        if self._closed:
            self._freed += 1
        else:
            frame.last_used = time.monotonic()
            self._idle.append(frame)
            if self._timer is None and len(self._idle) + self._in_use > self._min:
                self._schedule_cleanup()  # one frame above min_frames at least
        if self._in_use == 0 and self._drained is not None:
            self._drained.set()

    def cleanup(self, now: float | None = None) -> int:
        """Free frames idle for longer than the interval, down to min_frames; return how many."""
        now = time.monotonic() if now is None else now
        keep = [f for f in self._idle if now - f.last_used < self._interval]
        old = [f for f in self._idle if now - f.last_used >= self._interval]
        old.sort(key=lambda f: f.last_used, reverse=True)  # keep the most recently used
        while old and self.total - len(old) < self._min:
            keep.append(old.pop(0))
        self._idle = keep
        self._freed += len(old)
        return len(old)

    async def wait_idle(self) -> None:
        """Wait until no frame is in use and nobody waits for one."""
        while self._in_use or self._waiters:
            if self._drained is None or self._drained.is_set():
                self._drained = anyio.Event()  # shared by concurrent callers
            await self._drained.wait()

    def close(self) -> None:
        """Refuse new acquisitions and free the idle frames (in-use ones come back later)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._freed += len(self._idle)
        self._idle.clear()

    def statistics(self) -> FramePoolStatistics:
        return FramePoolStatistics(
            max_frames=self._max,
            total=self.total,
            in_use=self._in_use,
            idle=len(self._idle),
            waiters=self._gate.waiting(),
            created=self._created,
            freed=self._freed,
            high_water=self._high_water,
            max_waiters=self._max_waiters,
            refused=self._refused,
        )

    # -- internals ---------------------------------------------------------------------------

    def _take(self, frame: ExecutionFrame) -> ExecutionFrame:
        self._in_use += 1
        if self._in_use > self._high_water:
            self._high_water = self._in_use
        return frame

    def _schedule_cleanup(self) -> None:
        if self._timer is not None or self._interval <= 0 or self._closed:
            return
        if len(self._idle) + self._in_use <= self._min:
            return
        self._timer = current_loop().call_later(self._interval, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.cleanup()
        if self._idle:
            self._schedule_cleanup()
