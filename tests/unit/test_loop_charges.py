"""LoopCharges (asyncgraph/cuda/loop_charges.py) alone: no GPU, no Executor.

An execution's fixed host work takes the loop's slice: those that find it spent wait in
arrival order, each later iteration lets through as many as its slice has room for by the
measured cost of one (never fewer than one), and a waiter cancelled before or after it was
let through neither stalls nor loses the others. Each test runs on asyncio (debug mode) and
trio inside a leak check (tests/support/backends.py's `run`).
"""

from __future__ import annotations

import itertools
import time

import anyio
import anyio.lowlevel
import pytest

from asyncgraph.cuda.loop_charges import LoopCharges
from tests.support.backends import run

SLICE_S = 2e-3
WORK_S = 4e-4  # one "execution's" fixed work, spun on the loop: about 5 fit in a slice


async def start(charges: LoopCharges) -> None:
    """What the Executor does before an execution starts."""
    if not charges.admits():
        await charges.admit()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.timeout(60)
def test_waiters_go_through_in_arrival_order_about_a_slice_per_iteration(backend: str) -> None:
    async def body() -> None:
        charges = LoopCharges(SLICE_S)
        arrived: list[int] = []
        order: list[int] = []
        iterations: list[int] = []  # executions through, after each iteration

        async def execution(k: int) -> None:
            arrived.append(k)
            await start(charges)
            order.append(k)
            spin(WORK_S)

        async def probe() -> None:
            while len(order) < 24:
                iterations.append(len(order))
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as group:
            for k in range(24):
                group.start_soon(execution, k)
            group.start_soon(probe)
        per_iteration = [iterations[0], *(b - a for a, b in itertools.pairwise(iterations))]
        assert sorted(order) == list(range(24))
        if backend == "asyncio":
            assert order == arrived
        else:  # let through in arrival order; trio runs those of one wake in an order of its own
            assert all(arrived.index(k) < i + 12 for i, k in enumerate(order)), (arrived, order)
        # a slice holds 5 of them; the first iteration may extend it while nothing else waits
        assert max(per_iteration) <= 12, per_iteration
        s = charges.statistics()
        assert s.waiting == 0
        assert 12 <= s.deferred <= 24, s  # each waits once: no wake only to queue again
        assert WORK_S * 0.8 <= s.cost_s <= SLICE_S, s  # measured, not the prior

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_cancelled_waiter_stalls_nobody_whether_or_not_it_was_let_through(
    backend: str,
) -> None:
    """Cancelled while queued, a waiter leaves no entry; cancelled after `_wake` let it
    through but before it ran, it still counts as through, so the next wake comes. Each
    execution's work fills a slice: about one goes through per iteration (on trio a slice
    can span two of its batches, so a wake may let two through)."""
    async def body() -> None:
        charges = LoopCharges(SLICE_S)
        charges.cost_s, charges._measured = SLICE_S, True  # as measured later: one a wake
        arrived: list[int] = []
        through: list[int] = []
        scopes: dict[int, anyio.CancelScope] = {}

        async def execution(k: int) -> None:
            with anyio.CancelScope() as scope:
                scopes[k] = scope
                arrived.append(k)
                await start(charges)
                through.append(k)
                spin(SLICE_S)

        async def burst(ks: range) -> None:
            charges.open()
            spin(SLICE_S)  # the slice is open and spent: everyone after waits
            for k in ks:
                group.start_soon(execution, k)
            while len(arrived) < ks.stop:
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as group:
            await burst(range(8))
            queued = [k for k in arrived if k not in through][-3:]
            for k in queued:
                scopes[k].cancel()
        expected = [k for k in arrived if k not in queued]
        if backend == "asyncio":
            assert through == expected, (arrived, through)
        else:  # trio runs the executions one wake lets through in an order of its own
            assert sorted(through) == sorted(expected), (arrived, through)
        assert charges.statistics().waiting == 0

        async with anyio.create_task_group() as group:
            await burst(range(8, 16))
            while charges._woken == 0:
                await anyio.lowlevel.checkpoint()
            woken = next(k for k in arrived if k not in through)  # let through, not run yet
            scopes[woken].cancel()
        assert set(through) >= set(range(8, 16)) - {woken}, through
        assert charges.statistics().waiting == 0 and charges._woken == 0

    run(body, backend)
