"""Reliability scenario 9: a Hypothesis stateful model of the FramePool.

Rules: acquire, release, cancel a waiter, release-then-cancel (the frame is handed to a waiter
that is cancelled before it runs: anyio #398), cleanup of idle frames, close (aclose) with a
wait_idle watcher. After every step, on a real event loop (asyncio in debug mode, and uvloop):
- in_use + idle == total <= max_frames, and in_use, idle and waiters equal the model's;
- waiters are served first come, first served (the model predicts which caller gets a frame);
- a cancelled call ends cancelled and never gets a frame; no frame is held twice;
- after close, acquire fails at once and wait_idle ends exactly when nothing is in use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asyncgraph import ExecutorClosedError, ExecutorConfig, GraphBuilder
from asyncgraph.kernels import KernelFactory
from asyncgraph.runtime.frame import ExecutionFrame
from asyncgraph.runtime.plan import build_plan
from asyncgraph.runtime.pool import FramePool


def _plan() -> Any:
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(lambda v: v, x, name="ident", placement="inline"))
    graph = b.build()
    return build_plan(graph, KernelFactory().create(graph), ExecutorConfig())


PLAN = _plan()


def _debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 10.0
    return loop


@dataclass
class Call:
    """One acquire() call and what became of it."""

    id: int
    task: asyncio.Task[ExecutionFrame]


class FramePoolMachine(RuleBasedStateMachine):
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = staticmethod(_debug_loop)

    def __init__(self) -> None:
        super().__init__()
        self.loop = self.loop_factory()
        self.pool: FramePool | None = None
        self.max = 1
        self.min = 0
        self.holders: list[Call] = []
        self.waiting: list[Call] = []
        self.cancelled: list[Call] = []
        self.idle = 0
        self.closed = False
        self.idle_watch: asyncio.Task[None] | None = None
        self.ids = 0

    # -- helpers ---------------------------------------------------------------------------

    def settle(self) -> None:
        async def steps() -> None:
            for _ in range(6):
                await asyncio.sleep(0)

        self.loop.run_until_complete(steps())

    @property
    def in_use(self) -> int:
        return len(self.holders)

    def _new_frame(self, i: int) -> ExecutionFrame:
        return ExecutionFrame(PLAN, i)

    def _serve_release(self) -> None:
        """Model of release(): the oldest waiter gets the frame, else it goes idle or is freed."""
        if self.waiting:
            self.holders.append(self.waiting.pop(0))
            return
        if not self.closed:
            self.idle += 1

    # -- rules -----------------------------------------------------------------------------

    @initialize(max_frames=st.integers(1, 3), min_share=st.floats(0, 1))
    def setup(self, max_frames: int, min_share: float) -> None:
        self.max = max_frames
        self.min = int(min_share * max_frames)
        self.pool = FramePool(self._new_frame, self.max, self.min, cleanup_interval_s=0)

    @rule()
    def acquire(self) -> None:
        assert self.pool is not None
        self.ids += 1
        call = Call(self.ids, self.loop.create_task(self.pool.acquire()))
        self.settle()
        if self.closed:
            assert call.task.done() and isinstance(call.task.exception(), ExecutorClosedError)
            return
        free = self.idle > 0 or self.in_use + self.idle < self.max
        if not self.waiting and free:
            assert call.task.done(), "a free frame was not handed out at once"
            self.holders.append(call)
            if self.idle:
                self.idle -= 1
        else:
            assert not call.task.done(), "a caller jumped the queue"
            self.waiting.append(call)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        assert self.pool is not None
        call = data.draw(st.sampled_from(self.holders))
        self.holders.remove(call)
        self.pool.release(call.task.result())
        self._serve_release()
        self.settle()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel_waiter(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from(self.waiting))
        call.task.cancel()
        self.settle()
        self.waiting.remove(call)
        self.cancelled.append(call)

    @precondition(lambda self: self.holders and self.waiting)
    @rule(data=st.data())
    def release_then_cancel(self, data: st.DataObject) -> None:
        """Hand a frame to the oldest waiter, then cancel it before it ever runs."""
        assert self.pool is not None
        call = data.draw(st.sampled_from(self.holders))
        self.holders.remove(call)
        first = self.waiting.pop(0)
        self.pool.release(call.task.result())
        first.task.cancel()
        self.settle()
        self.cancelled.append(first)
        self._serve_release()  # the cancelled waiter passes its frame on

    @rule()
    def cleanup(self) -> None:
        assert self.pool is not None
        freed = self.pool.cleanup(now=1e12)
        expected = min(self.idle, max(0, self.in_use + self.idle - self.min))
        assert freed == expected
        self.idle -= freed

    @precondition(lambda self: not self.closed and self.ids >= 8)  # explore before closing
    @rule()
    def aclose(self) -> None:
        assert self.pool is not None
        self.pool.close()
        self.closed = True
        self.idle = 0
        self.idle_watch = self.loop.create_task(self.pool.wait_idle())
        self.settle()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def counts_agree(self) -> None:
        if self.pool is None:
            return
        stats = self.pool.statistics()
        assert stats.in_use + stats.idle == stats.total <= stats.max_frames
        assert (stats.in_use, stats.idle, stats.waiters) == (
            self.in_use, self.idle, len(self.waiting)
        )
        assert stats.high_water <= stats.max_frames

    @invariant()
    def calls_agree(self) -> None:
        assert all(c.task.done() for c in self.holders), "the model's next caller has no frame"
        frames = [c.task.result() for c in self.holders]
        assert len({id(f) for f in frames}) == len(frames), "one frame held twice"
        assert not any(c.task.done() for c in self.waiting), "a waiter was served out of turn"
        assert all(c.task.cancelled() for c in self.cancelled), "a cancelled call got a result"

    @invariant()
    def wait_idle_ends_when_idle(self) -> None:
        if self.idle_watch is not None:
            quiet = not self.holders and not self.waiting
            assert self.idle_watch.done() == quiet

    def teardown(self) -> None:
        """Clean up without raising, so a failing step's error is the one reported."""
        try:
            if self.pool is not None:
                for call in self.holders + self.waiting:
                    task = call.task
                    if task.done() and not task.cancelled() and task.exception() is None:
                        self.pool.release(task.result())
                    else:
                        task.cancel()
                self.pool.close()

            async def drain() -> None:
                current = asyncio.current_task()
                leftover = [t for t in asyncio.all_tasks() if t is not current]
                for task in leftover:
                    task.cancel()
                await asyncio.gather(*leftover, return_exceptions=True)

            self.loop.run_until_complete(drain())
        finally:
            self.loop.close()


class UvloopFramePoolMachine(FramePoolMachine):
    loop_factory = staticmethod(uvloop.new_event_loop)


@pytest.mark.parametrize(
    "machine", [FramePoolMachine, UvloopFramePoolMachine], ids=["asyncio", "uvloop"]
)
def test_frame_pool_model(machine: type[FramePoolMachine], request: pytest.FixtureRequest) -> None:
    slow = bool(request.config.getoption("--run-slow"))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=400 if slow else 40,
            stateful_step_count=60 if slow else 25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
