"""Reliability scenarios 1 and 2: cancellation at every checkpoint, and while a worker blocks.

Pass criteria (reliability under cancellation):
1. For a graph with N await points, cancelling at the k-th, for every k: the caller gets
   CancelledError and no result, every kernel that started has ended, nothing the cancelled
   execution produced is still referenced (no partial output escapes), the leak check is
   clean, and the next execution is correct.
2. Cancelling while a CPU worker thread is blocked in a kernel: the caller's cancellation
   completes only when the thread is done, the frame stays out of the pool until then, the
   late result never reaches another execution, and nothing is printed to stderr.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.testing import Gate, LeakChecker

pytestmark = pytest.mark.usefixtures("leak_check")


class Token:
    """A node's output that a weakref can watch."""

    __slots__ = ("__weakref__", "value")

    def __init__(self, value: int) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Token({self.value})"


class Checkpoints:
    """Async kernels with one await point each; the k-th await point cancels the caller."""

    def __init__(self) -> None:
        self.count = 0
        self.cancel_at: int | None = None
        self.victim: asyncio.Task[Any] | None = None
        self.started: list[str] = []
        self.ended: list[str] = []
        self.outputs: list[weakref.ref[Token]] = []

    def kernel(self, name: str, add: int) -> Any:
        async def run(*inputs: Token) -> Token:
            self.started.append(name)
            self.count += 1
            if self.count == self.cancel_at and self.victim is not None:
                self.victim.cancel()
            try:
                await asyncio.sleep(0)
            finally:
                self.ended.append(name)
            out = Token(sum(t.value for t in inputs) + add)
            self.outputs.append(weakref.ref(out))
            return out

        run.__name__ = name
        return run


def _inline_double(t: Token) -> Token:
    return Token(2 * t.value)


def checkpoint_graph(cp: Checkpoints, with_worker: bool = False) -> tuple[Graph, int]:
    """x -> a -> (b, c) -> d -> e (inline) -> f; outputs (d, f). Returns (graph, N)."""
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(cp.kernel("a", 1), x)
    left = b.call(cp.kernel("b", 10), a)
    right = b.call(cp.kernel("c", 100), a)
    if with_worker:
        right = b.call(_inline_double, right, name="worker_double", placement="worker")
    d = b.call(cp.kernel("d", 1000), left, right)
    e = b.call(_inline_double, d, name="e", placement="inline")
    f = b.call(cp.kernel("f", 5), e)
    b.output((d, f))
    return b.build(), 5


def expected(x: int, with_worker: bool = False) -> tuple[int, int]:
    a = x + 1
    right = a + 100
    if with_worker:
        right *= 2
    d = (a + 10) + right + 1000
    return d, 2 * d + 5


async def _settle(steps: int = 5) -> None:
    for _ in range(steps):
        await asyncio.sleep(0)


async def test_cancel_at_every_await_point() -> None:
    cp = Checkpoints()
    graph, n_points = checkpoint_graph(cp)
    async with Executor(graph, ExecutorConfig(max_concurrent_executions=2)) as ex:
        for k in range(1, n_points + 1):
            cp.count, cp.cancel_at = 0, k
            cp.started.clear()
            cp.ended.clear()
            cp.outputs.clear()
            async with LeakChecker(close_executors=False):
                x = Token(k)
                x_ref = weakref.ref(x)
                task = asyncio.create_task(ex.execute(x))
                cp.victim = task
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert task.cancelled(), f"k={k}: the caller must end cancelled"
                assert cp.count >= k, f"k={k}: only {cp.count} await points were reached"
                assert sorted(cp.started) == sorted(cp.ended), (
                    f"k={k}: kernels still running after the caller was cancelled: "
                    f"{set(cp.started) - set(cp.ended)}"
                )
                stats = ex.statistics()
                assert stats.frames.in_use == 0 and stats.frames.waiters == 0
                cp.victim = None
                del task, x
                await asyncio.sleep(0)  # the step that raised holds the exception until it ends
                gc.collect()
                alive = [r() for r in cp.outputs if r() is not None]
                assert not alive, f"k={k}: partial outputs of a cancelled run escaped: {alive}"
                assert x_ref() is None, f"k={k}: the cancelled run's input is still referenced"
            cp.cancel_at = None
            out = await ex.execute(Token(k))
            assert (out[0].value, out[1].value) == expected(k), f"k={k}: next run is wrong"
        assert ex.statistics().cancelled == n_points


async def test_cancel_after_every_loop_step_with_a_worker_node() -> None:
    """Cancel the caller after k loop iterations, for every k until the run finishes first."""
    cp = Checkpoints()
    graph, _ = checkpoint_graph(cp, with_worker=True)
    async with Executor(graph, ExecutorConfig(max_concurrent_executions=1)) as ex:
        finished_first = 0
        for k in range(0, 200):
            task = asyncio.create_task(ex.execute(Token(k)))
            await _settle(k)
            if task.done():
                finished_first += 1
                out = task.result()
                assert (out[0].value, out[1].value) == expected(k, with_worker=True)
                if finished_first >= 3:
                    break
                continue
            task.cancel()
            try:
                out = await task
            except asyncio.CancelledError:
                pass
            else:  # the result arrived before the cancellation did: it must be whole and right
                assert (out[0].value, out[1].value) == expected(k, with_worker=True)
            stats = ex.statistics()
            assert stats.frames.in_use == 0, f"k={k}: frame not returned"
            assert sorted(cp.started) == sorted(cp.ended), f"k={k}: a kernel still runs"
            out = await ex.execute(Token(7))
            assert (out[0].value, out[1].value) == expected(7, with_worker=True)
        assert finished_first >= 1, "the loop-step sweep never reached a completed run"
        assert ex.statistics().cancelled >= 3, "too few loop steps ended in a cancellation"


async def test_cancel_before_start_takes_no_frame() -> None:
    cp = Checkpoints()
    graph, _ = checkpoint_graph(cp)
    async with Executor(graph) as ex:
        task = asyncio.create_task(ex.execute(Token(1)))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = ex.statistics()
        assert stats.started == 0 and stats.frames.in_use == 0
        assert cp.started == []


# -- scenario 2 -----------------------------------------------------------------------------------


def blocked_worker_graph(gate: Gate, calls: list[str]) -> Graph:
    def slow(x: torch.Tensor) -> torch.Tensor:
        calls.append("slow")
        gate.wait_sync(timeout=30)
        return x * 2  # the late result

    def add_one(y: torch.Tensor) -> torch.Tensor:
        calls.append("add_one")
        return y + 1

    b = GraphBuilder()
    x = b.input("x")
    y = b.call(slow, x, placement="worker")
    b.output(b.call(add_one, y, placement="worker"))
    return b.build()


async def test_cancel_while_worker_blocked(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    gate = Gate()
    calls: list[str] = []
    config = ExecutorConfig(max_concurrent_executions=1, max_parallel_ops=2)
    async with Executor(blocked_worker_graph(gate, calls), config) as ex:
        first = asyncio.create_task(ex.execute(torch.full((3,), 1.0)))
        await gate.wait_entered(1)
        first.cancel()
        await _settle(20)
        assert not first.done(), "cancellation completed while the worker still held the frame"
        assert ex.statistics().frames.in_use == 1, "the frame went back while a thread used it"

        second = asyncio.create_task(ex.execute(torch.full((3,), 5.0)))
        await _settle(20)
        stats = ex.statistics()
        assert not second.done() and stats.frames.waiters == 1, "the next caller got the frame"
        gate.open()
        with pytest.raises(asyncio.CancelledError):
            await first
        out = await asyncio.wait_for(second, 30)
        torch.testing.assert_close(out, torch.full((3,), 11.0))
        assert calls.count("slow") == 2
        assert calls.count("add_one") == 1, "the cancelled run's late result was processed"
        stats = ex.statistics()
        assert (stats.cancelled, stats.completed) == (1, 1)
    err = capfd.readouterr().err
    assert err == "", f"something was printed to stderr: {err!r}"
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, f"warnings were logged: {[r.getMessage() for r in noisy]}"


async def test_cancel_twice_while_worker_blocked() -> None:
    """A second cancel() while the run drains is absorbed; the frame still waits for the thread."""
    gate = Gate()
    calls: list[str] = []
    config = ExecutorConfig(max_parallel_ops=1)
    async with Executor(blocked_worker_graph(gate, calls), config) as ex:
        task = asyncio.create_task(ex.execute(torch.ones(2)))
        await gate.wait_entered(1)
        task.cancel()
        await _settle(5)
        task.cancel()
        await _settle(5)
        assert not task.done() and ex.statistics().frames.in_use == 1
        gate.open()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ex.statistics().frames.in_use == 0
        assert calls == ["slow"]


async def test_kernel_that_swallows_cancellation_holds_the_frame_until_it_ends() -> None:
    log: list[str] = []

    async def stubborn(x: int) -> int:
        try:
            await asyncio.sleep(30 if x == 1 else 0)
        except asyncio.CancelledError:  # a badly behaved kernel: it keeps going
            log.append("swallowed")
            await asyncio.sleep(0.01)
            log.append("ended late")
        return x + 1

    async def after(y: int) -> int:
        log.append("after")
        return y * 2

    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(after, b.call(stubborn, x)))
    async with Executor(b.build(), ExecutorConfig(max_concurrent_executions=1)) as ex:
        task = asyncio.create_task(ex.execute(1))
        await _settle(5)
        task.cancel()
        await _settle(5)
        assert not task.done() and ex.statistics().frames.in_use == 1
        with pytest.raises(asyncio.CancelledError):
            await task
        assert log == ["swallowed", "ended late"], "the late result was passed on"
        assert await ex.execute(5) == 12
