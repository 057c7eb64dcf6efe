"""The event loop's thread gets `loop_intra_op_threads` when an Executor binds to it (issue 40):
lowered, never raised, and left alone with None.

Each case runs its loop on a thread of its own, so the count it sets stays there."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.testing import LeakChecker


def _graph() -> object:
    b = GraphBuilder()
    b.output(b.call(torch.relu, b.input("x"), name="relu", placement="inline"))
    return b.build()


def _count_after_execute(before: int, config: ExecutorConfig) -> tuple[int, int]:
    """torch's count on a fresh loop thread set to `before`, then after one execution."""
    seen: list[int] = []

    async def main() -> None:
        async with LeakChecker(), Executor(_graph(), config) as ex:
            seen.append(torch.get_num_threads())
            await ex.execute(torch.ones(2))
            seen.append(torch.get_num_threads())

    def thread() -> None:
        torch.set_num_threads(before)
        asyncio.run(main())

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(30)
    assert not worker.is_alive()
    return seen[0], seen[1]


@pytest.mark.parametrize(("before", "setting", "after"), [
    (2, 1, 1),  # the default: inline nodes run on one thread
    (1, 2, 1),  # never raised: a lower count the process chose stands
    (2, None, 2),  # None leaves the thread alone
])
def test_binding_sets_the_loop_threads_count(before: int, setting: int | None, after: int) -> None:
    config = ExecutorConfig(loop_intra_op_threads=setting)
    assert _count_after_execute(before, config) == (before, after)


def test_the_default_is_one_thread() -> None:
    assert ExecutorConfig().loop_intra_op_threads == 1
    with pytest.raises(ValueError, match="loop_intra_op_threads must be >= 1 or None, got 0"):
        ExecutorConfig(loop_intra_op_threads=0)
