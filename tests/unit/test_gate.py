"""HandOffQueue (asyncgraph/runtime/gate.py) alone: no pool, no server.

The frame pool and the admission gate wait in it, so what they promise rests on it: waiters
served in arrival order, a release handed to the oldest waiter and waking only that one, a
waiter cancelled while queued gone from the queue, and a waiter cancelled after it was
handed the value passing it on rather than losing it. The tests taking `backend` run on
asyncio (debug mode) and trio, each inside a leak check (tests/support/backends.py's `run`);
the plain async ones run on asyncio and uvloop, where a task can be cancelled after its wait
was handed the value (the release-then-cancel race of anyio #398).
"""

from __future__ import annotations

import asyncio

import anyio
import pytest
from anyio.abc import TaskGroup

from asyncgraph.runtime.gate import HandOffQueue
from tests.support.backends import run, settle, until


class Owner:
    """What a pool or a gate does around its HandOffQueue: a release hands the value to the
    oldest waiter, or keeps it free when nobody waits; `pass_on` is the wait's pass-on."""

    def __init__(self) -> None:
        self.gate: HandOffQueue[str] = HandOffQueue()
        self.free: list[str] = []
        self.passed_on: list[str] = []

    def release(self, value: str) -> None:
        if not self.gate.hand_over(value):
            self.free.append(value)

    def pass_on(self, value: str) -> None:
        self.passed_on.append(value)
        self.release(value)

    async def take_turn(self, k: int, served: list[tuple[int, str]],
                        scope: anyio.CancelScope | None = None) -> None:
        """Wait for the value, use it a moment (a cancellation pending is delivered there),
        then release it on every path."""
        with scope or anyio.CancelScope():
            value = await self.gate.wait(self.pass_on)
            try:
                await anyio.sleep(0.001)
                served.append((k, value))
            finally:
                self.release(value)

    def assert_empty(self) -> None:
        assert len(self.gate) == 0 and self.gate.waiting() == 0 and not self.gate.queue


async def _queue(owner: Owner, group: TaskGroup, k: int,
                 served: list[tuple[int, str]], scope: anyio.CancelScope | None = None) -> None:
    """Start waiter `k` and wait until it queued (so the waiters queue in the order of k)."""
    group.start_soon(owner.take_turn, k, served, scope)
    await until(lambda: len(owner.gate) == k + 1, f"waiter {k} never queued")


def test_waiters_are_served_in_arrival_order(backend: str) -> None:
    async def body() -> None:
        owner = Owner()
        served: list[tuple[int, str]] = []
        async with anyio.create_task_group() as group:
            for k in range(5):
                await _queue(owner, group, k, served)
            assert owner.gate.waiting() == 5
            owner.release("turn")
        assert served == [(k, "turn") for k in range(5)]
        assert owner.free == ["turn"] and owner.passed_on == []
        owner.assert_empty()

    run(body, backend)


def test_a_release_wakes_only_the_oldest_waiter(backend: str) -> None:
    """No thundering herd: one hand-over, one waiter woken, the others still queued."""

    async def body() -> None:
        gate: HandOffQueue[str] = HandOffQueue()
        woken: list[tuple[int, str]] = []

        async def wait(k: int) -> None:
            woken.append((k, await gate.wait(lambda value: None)))

        async with anyio.create_task_group() as group:
            for k in range(3):
                group.start_soon(wait, k)
                await until(lambda k=k: len(gate) == k + 1, f"waiter {k} never queued")
            assert gate.hand_over("first")
            await settle()
            assert woken == [(0, "first")]
            assert len(gate) == gate.waiting() == 2
            assert gate.hand_over("second") and gate.hand_over("third")
        # each got the value handed to it in turn (trio may run the two woken in any order)
        assert sorted(woken) == [(0, "first"), (1, "second"), (2, "third")]
        assert not gate.hand_over("fourth")  # nobody waits: the value stays the caller's
        assert len(gate) == gate.waiting() == 0

    run(body, backend)


def test_a_waiter_cancelled_while_queued_leaves_the_queue(backend: str) -> None:
    async def body() -> None:
        owner = Owner()
        served: list[tuple[int, str]] = []
        leaving = anyio.CancelScope()
        async with anyio.create_task_group() as group:
            await _queue(owner, group, 0, served)
            await _queue(owner, group, 1, served, leaving)
            await _queue(owner, group, 2, served)
            leaving.cancel()
            await until(lambda: len(owner.gate) == 2, "the cancelled waiter stayed queued")
            assert owner.gate.waiting() == 2
            owner.release("turn")
        assert leaving.cancelled_caught
        assert served == [(0, "turn"), (2, "turn")]  # skipped, not handed anything
        assert owner.free == ["turn"] and owner.passed_on == []
        owner.assert_empty()

    run(body, backend)


def test_a_waiter_cancelled_after_the_hand_over_loses_nothing(backend: str) -> None:
    """Cancelled by its scope after the value was handed to it, before it ran: trio (and anyio
    on asyncio, which does not cancel a task whose future is done) lets the wait return the
    value and delivers the cancellation at the next checkpoint, where the waiter's own
    release passes it on. Either way the next waiter gets it."""

    async def body() -> None:
        owner = Owner()
        served: list[tuple[int, str]] = []
        handed = anyio.CancelScope()
        async with anyio.create_task_group() as group:
            await _queue(owner, group, 0, served, handed)
            await _queue(owner, group, 1, served)
            owner.release("turn")  # hands it to waiter 0...
            handed.cancel()  # ...which is cancelled before it runs
        assert handed.cancelled_caught
        assert served == [(1, "turn")]
        assert owner.free == ["turn"]
        owner.assert_empty()

    run(body, backend)


@pytest.mark.usefixtures("leak_check")
async def test_a_task_cancelled_after_the_hand_over_passes_it_on() -> None:
    """asyncio's task.cancel() after the hand-over (anyio #398) raises at the wait itself, with
    the value already handed: the wait passes it on, to the next waiter, or back to the
    owner's free values when nobody waits."""
    owner = Owner()
    handed = asyncio.create_task(owner.gate.wait(owner.pass_on))
    behind = asyncio.create_task(owner.gate.wait(owner.pass_on))
    await asyncio.sleep(0)
    assert owner.gate.hand_over("turn")  # hands it to `handed`'s future...
    handed.cancel()  # ...and the task is cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await handed
    assert owner.passed_on == ["turn"]
    assert await asyncio.wait_for(behind, timeout=5) == "turn"

    alone = asyncio.create_task(owner.gate.wait(owner.pass_on))
    await asyncio.sleep(0)
    assert owner.gate.hand_over("again")
    alone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await alone
    assert owner.passed_on == ["turn", "again"] and owner.free == ["again"]
    owner.assert_empty()


@pytest.mark.usefixtures("leak_check")
async def test_a_task_cancelled_while_queued_leaves_the_queue() -> None:
    owner = Owner()
    leaving = asyncio.create_task(owner.gate.wait(owner.pass_on))
    staying = asyncio.create_task(owner.gate.wait(owner.pass_on))
    await asyncio.sleep(0)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert len(owner.gate) == owner.gate.waiting() == 1
    owner.release("turn")
    assert await asyncio.wait_for(staying, timeout=5) == "turn"
    assert owner.passed_on == [] and owner.free == []
    owner.assert_empty()
