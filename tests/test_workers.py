"""WorkerPool and its ReadyQueue: ranked order, stop tokens, statistics."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from asyncgraph.workers import ReadyQueue, WorkerPool

pytestmark = pytest.mark.usefixtures("leak_check")


def _noop(frame: Any, unit: int) -> None:
    pass


def test_the_queue_returns_the_lowest_rank_first_and_ties_in_order() -> None:
    q = ReadyQueue()
    q.put([((2, -1.0), (_noop, None, 0)), ((1, -1.0), (_noop, None, 1))])
    q.put([((1, -5.0), (_noop, None, 2)), ((1, -1.0), (_noop, None, 3))])
    assert len(q) == 4
    units = []
    for _ in range(4):
        item = q.get()
        assert item is not None
        units.append(item[2])
    # execution 1 before execution 2; in execution 1 the most work ahead first; ties FIFO
    assert units == [2, 1, 3, 0]
    assert len(q) == 0


def test_stop_tokens_come_after_the_items_queued_before() -> None:
    q = ReadyQueue()
    q.put([((0, 0.0), (_noop, None, 7))])
    q.stop(2)
    item = q.get()
    assert item is not None and item[2] == 7
    assert q.get() is None and q.get() is None


async def test_a_busy_pool_runs_queued_items_best_rank_first() -> None:
    """Queued items run lowest rank first, whatever order they were submitted in."""
    pool = WorkerPool(1)
    entered, gate, done = threading.Event(), threading.Event(), threading.Event()
    order: list[int] = []

    def block(frame: Any, unit: int) -> None:
        entered.set()
        gate.wait(10)

    def record(frame: Any, unit: int) -> None:
        order.append(unit)
        if len(order) == 3:
            done.set()

    try:
        pool.submit(block, None, [((0, 0.0), 0)])
        assert entered.wait(10)  # the only thread is busy until the gate opens
        pool.submit(record, None, [((0, -1.0), 1), ((0, -3.0), 3), ((0, -2.0), 2)])
        assert pool.statistics().queued == 3
        gate.set()
        assert done.wait(10)
        assert order == [3, 2, 1]
    finally:
        gate.set()
        await pool.aclose()
    stats = pool.statistics()
    assert stats.threads == 0 and stats.queued == 0 and stats.items_run == 4
