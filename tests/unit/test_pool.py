"""FramePool: bounded, first come first served, cancellation-safe, idle frames cleaned up."""

from __future__ import annotations

import asyncio

import pytest

from asyncgraph import ExecutorClosedError, FramePool, OverloadedError
from asyncgraph.runtime.frame import ExecutionFrame
from asyncgraph.runtime.plan import ExecutionPlan


def _plan() -> ExecutionPlan:
    return ExecutionPlan(
        num_values=2, calls=(), outputs=(), users=(),
        read_counts=(0, 0), frees=(), keep_output=(), retained=(), placement=(),
        user_input_slots=(), token_slots=(), weight_slots=(),
    )


def _pool(max_frames: int = 1, min_frames: int = 0, interval: float = 600.0) -> FramePool:
    plan = _plan()
    return FramePool(lambda i: ExecutionFrame(plan, i), max_frames, min_frames, interval)


async def test_waiters_are_served_first_come_first_served() -> None:
    pool = _pool(max_frames=1)
    held = await pool.acquire()
    order: list[int] = []

    async def waiter(k: int) -> None:
        frame = await pool.acquire()
        order.append(k)
        await asyncio.sleep(0)
        pool.release(frame)

    tasks = [asyncio.create_task(waiter(k)) for k in range(5)]
    await asyncio.sleep(0)
    assert pool.statistics().waiters == 5
    pool.release(held)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    stats = pool.statistics()
    assert (stats.total, stats.in_use, stats.idle, stats.waiters) == (1, 0, 1, 0)


async def test_release_then_cancel_passes_the_frame_on() -> None:
    """anyio #398: a waiter handed a frame and cancelled before it runs must not leak it."""
    pool = _pool(max_frames=1)
    held = await pool.acquire()
    b = asyncio.create_task(pool.acquire())
    c = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)
    pool.release(held)  # hands the frame to b's future...
    b.cancel()  # ...and b is cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await b
    frame = await asyncio.wait_for(c, timeout=5)  # c gets it: nothing was skipped
    assert frame is held
    pool.release(frame)
    stats = pool.statistics()
    assert (stats.in_use, stats.idle, stats.waiters, stats.total) == (0, 1, 0, 1)


async def test_cancelled_waiter_leaves_no_trace() -> None:
    pool = _pool(max_frames=1)
    held = await pool.acquire()
    waiter = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.statistics().waiters == 0
    pool.release(held)
    assert (await pool.acquire()) is held
    pool.release(held)


async def test_never_more_than_max_frames() -> None:
    pool = _pool(max_frames=3)
    peak = 0

    async def user() -> None:
        nonlocal peak
        frame = await pool.acquire()
        peak = max(peak, pool.statistics().in_use)
        await asyncio.sleep(0.001)
        pool.release(frame)

    await asyncio.gather(*(user() for _ in range(50)))
    stats = pool.statistics()
    assert peak == 3 and stats.high_water == 3 and stats.total <= 3 and stats.created == 3


async def test_idle_frames_are_freed_down_to_min_frames() -> None:
    pool = _pool(max_frames=4, min_frames=1, interval=100.0)
    frames = [await pool.acquire() for _ in range(4)]
    for frame in frames:
        pool.release(frame)
    assert pool.statistics().idle == 4
    last = max(f.last_used for f in frames)
    assert pool.cleanup(now=last + 50) == 0  # not idle long enough
    assert pool.cleanup(now=last + 100) == 3
    stats = pool.statistics()
    assert (stats.total, stats.idle, stats.freed) == (1, 1, 3)
    pool.close()


async def test_cleanup_timer_frees_idle_frames() -> None:
    pool = _pool(max_frames=3, min_frames=1, interval=0.02)
    frames = [await pool.acquire() for _ in range(3)]
    for frame in frames:
        pool.release(frame)
    for _ in range(200):
        if pool.statistics().total == 1:
            break
        await asyncio.sleep(0.01)
    assert pool.statistics().total == 1
    pool.close()


async def test_closed_pool_refuses_acquire() -> None:
    pool = _pool()
    pool.close()
    with pytest.raises(ExecutorClosedError):
        await pool.acquire()


async def test_waiters_beyond_max_waiters_are_refused_at_once() -> None:
    plan = _plan()
    pool = FramePool(lambda i: ExecutionFrame(plan, i), 1, 0, 600.0, max_waiters=2)
    held = await pool.acquire()
    waiters = [asyncio.create_task(pool.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(OverloadedError, match=r"max_frame_waiters=2") as info:
        await pool.acquire()
    assert info.value.limit == 2
    stats = pool.statistics()
    assert (stats.waiters, stats.refused, stats.max_waiters) == (2, 1, 2)
    pool.release(held)
    for task in waiters:
        pool.release(await task)
    stats = pool.statistics()
    assert (stats.in_use, stats.waiters, stats.total) == (0, 0, 1)
    pool.release(await pool.acquire())  # below the bound again: served at once
