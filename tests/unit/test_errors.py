"""Kernel errors reach the caller with their own type, attributes and node context."""

from __future__ import annotations

import asyncio
import operator
import time
from typing import Any

import pytest
import torch

import asyncgraph
from asyncgraph import ExecutorConfig, GraphBuilder
from asyncgraph.runtime.loop_budget import LoopBudget

pytestmark = pytest.mark.usefixtures("leak_check")


class QuotaError(Exception):
    def __init__(self, message: str, remaining: int) -> None:
        super().__init__(message)
        self.remaining = remaining


def over_quota(x: int) -> int:
    raise QuotaError("quota exhausted", remaining=x)


class Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx) * 2


@pytest.mark.parametrize("placement", ["inline", "worker"])
async def test_python_kernel_error_keeps_type_attributes_and_names_node(placement: str) -> None:
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(over_quota, x, name="charge", placement=placement)
    b.output(y)
    async with asyncgraph.Executor(b.build()) as ex:
        with pytest.raises(QuotaError) as info:
            await ex.execute(7)
        assert info.value.remaining == 7
        assert info.value.__notes__ == [
            f"While executing %charge = {__name__}.over_quota(...) [node 0]"
        ]
        stats = ex.statistics()
        assert (stats.failed, stats.completed, stats.frames.in_use) == (1, 0, 0)


async def test_aten_error_names_node_and_user_source_line() -> None:
    model = Lookup()
    ep = torch.export.export(model, (torch.tensor([1, 2]),))
    async with asyncgraph.Executor(ep) as ex:
        with pytest.raises(IndexError) as info:
            await ex.execute(torch.tensor([1, 99]))
        note = info.value.__notes__[-1]
        assert note.startswith("While executing %embedding = aten.embedding.default(...)")
        assert "test_errors.py" in note and "self.emb(idx)" in note
        # the executor still works afterwards
        out = await ex.execute(torch.tensor([3, 4]))
        torch.testing.assert_close(out, model(torch.tensor([3, 4])))


async def test_async_kernel_error_propagates() -> None:
    async def fetch(x: int) -> int:
        raise TimeoutError(f"backend timed out for {x}")

    b = GraphBuilder()
    b.output(b.call(fetch, b.input("x")))
    async with asyncgraph.Executor(b.build()) as ex:
        with pytest.raises(TimeoutError, match="backend timed out for 3"):
            await ex.execute(3)


async def test_two_failing_branches_give_an_exception_group() -> None:
    import threading

    barrier = threading.Barrier(2, timeout=10)

    def fail_left(x: int) -> int:
        barrier.wait()
        raise ValueError("left")

    def fail_right(x: int) -> int:
        barrier.wait()
        raise KeyError("right")

    b = GraphBuilder()
    x = b.input("x")
    b.output([b.call(fail_left, x), b.call(fail_right, x)])
    async with asyncgraph.Executor(b.build(), ExecutorConfig(max_parallel_ops=2)) as ex:
        with pytest.raises(ExceptionGroup) as info:
            await ex.execute(1)
        group = info.value
        assert group.message == "2 nodes failed in one execution"
        assert sorted(type(e).__name__ for e in group.exceptions) == ["KeyError", "ValueError"]


@pytest.mark.parametrize("preempted", [False, True])
async def test_error_cancels_async_kernels_that_have_not_started_yet(
    monkeypatch: pytest.MonkeyPatch, preempted: bool
) -> None:
    """Regression: a task cancelled before its first step never runs its own code, so the
    scheduler must account for it from the done-callback, or the execution never finishes.

    `preempted`: the thread loses the CPU (or the collector runs) between opening the loop's
    slice and checking it before the first inline root. That used to defer the root to the
    next iteration, after the async kernels' first steps ([1, 1] != [], seen once under
    `make test`); the first unit of a slice that the execution opened now always runs.
    """
    if preempted:
        open_slice = LoopBudget.deadline

        def spent_before_use(self: LoopBudget) -> float | None:
            deadline = open_slice(self)
            while deadline is not None and time.perf_counter() <= deadline:
                pass
            return deadline

        monkeypatch.setattr(LoopBudget, "deadline", spent_before_use)
    started: list[int] = []

    async def remote(x: int) -> int:
        started.append(x)
        return x

    def broken(x: int) -> int:
        raise ValueError("inline failure")

    b = GraphBuilder()
    x = b.input("x")
    b.output([b.call(remote, x), b.call(remote, x, name="remote2"),
              b.call(broken, x, placement="inline")])
    async with asyncgraph.Executor(b.build()) as ex:
        with pytest.raises(ValueError, match="inline failure"):
            await ex.execute(1)
        assert started == []
        assert ex.statistics().frames.in_use == 0


@pytest.mark.timeout(60)
async def test_a_worker_error_cancels_an_async_kernel_started_while_it_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a worker's failure read the frame's tasks without the loop's order: when
    the loop had checked `stopped` but not yet added the new task, the failure saw no task to
    cancel, and the failed execution waited out the whole async kernel. The interleaving is
    forced: the loop pauses between its check and the add until the worker has failed."""
    import threading

    import asyncgraph.runtime.scheduler as scheduler_module
    from asyncgraph.runtime.scheduler import Scheduler

    in_window = threading.Event()  # the loop is between the check and the add
    worker_failed = threading.Event()
    completed: list[int] = []

    def fail_once_the_loop_starts_the_task(x: int) -> int:
        assert in_window.wait(10)
        raise ValueError("worker failure")

    async def remote(x: int) -> int:
        await asyncio.sleep(2)
        completed.append(x)
        return x

    create_kernel_coroutine = Scheduler._await_kernel
    fail = scheduler_module.fail

    def paused_before_the_add(self: Scheduler, *args: Any) -> Any:
        in_window.set()
        assert worker_failed.wait(10)
        return create_kernel_coroutine(self, *args)

    def signalled_fail(*args: Any, **kwargs: Any) -> None:
        fail(*args, **kwargs)
        if threading.current_thread().name.startswith("asyncgraph-worker"):
            worker_failed.set()

    monkeypatch.setattr(Scheduler, "_await_kernel", paused_before_the_add)
    monkeypatch.setattr(scheduler_module, "fail", signalled_fail)
    b = GraphBuilder()
    x = b.input("x")
    before = b.call(operator.add, x, 1, name="before", placement="inline")
    b.output([b.call(fail_once_the_loop_starts_the_task, x, placement="worker"),
              b.call(remote, before)])
    config = ExecutorConfig(adaptive_placement=False, max_parallel_ops=1)
    async with asyncgraph.Executor(b.build(), config) as ex:
        with pytest.raises(ValueError, match="worker failure"):
            await ex.execute(1)
        assert completed == [], "the async kernel ran to its end after the execution failed"
        assert ex.statistics().frames.in_use == 0


async def test_a_sticky_cuda_error_from_finish_keeps_the_nodes_error() -> None:
    """A CUDA error is sticky: the GPU work's `finish` may raise again what a node raised.
    The caller gets the node's error (it names the node), with finish's as a note."""
    from asyncgraph.runtime.scheduler import Scheduler

    class Frame:
        errors: list[BaseException] = [ValueError("node failed")]

    class Gpu:
        async def finish(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    frame = Frame()
    await Scheduler._finish_gpu(frame, Gpu())  # type: ignore[arg-type]
    assert str(frame.errors[0]) == "node failed"
    assert "illegal memory access" in frame.errors[0].__notes__[0]

    frame.errors = []
    with pytest.raises(RuntimeError, match="illegal memory access"):  # no node error: finish's
        await Scheduler._finish_gpu(frame, Gpu())  # type: ignore[arg-type]
