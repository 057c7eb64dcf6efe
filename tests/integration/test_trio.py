"""The Executor's contract on trio, beside asyncio: the same test bodies run on both.

Each test is a plain function that runs its body with `anyio.run(body, backend=...)`, for
"asyncio" (debug mode) and "trio": it takes tests/conftest.py's `backend` fixture and calls
`run(body, backend)` (tests/support/backends.py). Not pytest's anyio plugin nor pytest-trio:
the suite runs pytest-asyncio in auto mode (tests/conftest.py's asyncio + uvloop matrix),
which claims every `async def` test and fixture, so an anyio-marked test's "trio" case ran on
asyncio. A sync test that starts its own run is unambiguous. Every body ends with the leak check.

On trio: results (inline, worker and async kernels), kernel errors, cancellation by cancel
scopes (`CancelScope.cancel`, `move_on_after`, `fail_after`) while a worker blocks or an async
kernel awaits, `aclose(cancel=True)` cancelling running executions, frame waiters and batched
requests (asyncio: CancelledError; trio: ExecutorClosedError, never
concurrent.futures.CancelledError; the caller's own cancel scope wins), the frame pool under
contention with cancelled waiters, batching, the loop slice's fairness, a straight line run
on a worker and cancelled there, the leak check itself, and one soak at ASYNCGRAPH_SOAK_SCALE.
Programs with CUDA nodes: tests/integration/test_trio_gpu.py.
"""

from __future__ import annotations

import concurrent.futures
import functools
import random
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import torch
from torch.export import Dim

from asyncgraph import BatchingConfig, Executor, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.backend import current_loop
from asyncgraph.runtime.config import usable_cpus
from asyncgraph.runtime.loop_budget import loop_budget
from asyncgraph.runtime.scheduler import Scheduler
from asyncgraph.testing import FaultInjector, LeakChecker
from asyncgraph.testing.leaks import LeakError
from tests.support.backends import (
    closed_by_cancel,
    outcome_of,
    run,
    settle,
    until,
)
from tests.support.soak import soak


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def mixed_graph() -> Graph:
    """Inline, worker and async kernels: the loop, threads handing back, tasks."""

    async def async_scale(x: torch.Tensor) -> torch.Tensor:
        await anyio.lowlevel.checkpoint()
        return x * 3

    b = GraphBuilder()
    x = b.input("x")
    a = b.call(add_one, x, name="a", placement="inline")
    w = b.call(double, a, name="w", placement="worker")
    t = b.call(async_scale, a, name="t")
    b.output(b.call(torch.add, w, t, name="sum", placement="inline"))
    return b.build()


def mixed_expected(x: torch.Tensor) -> torch.Tensor:
    return (x + 1) * 2 + (x + 1) * 3


class Blocker:
    """A worker kernel that blocks its thread until `release()`; records what happened."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.log: list[str] = []

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append("blocked")
        self.entered.set()
        self.gate.wait(30)
        self.log.append("released")
        return x * 2

    def release(self) -> None:
        self.gate.set()

    def graph(self) -> Graph:
        def after(y: torch.Tensor) -> torch.Tensor:
            self.log.append("after")
            return y + 1

        b = GraphBuilder()
        x = b.input("x")
        y = b.call(self.kernel, x, name="blocking", placement="worker")
        b.output(b.call(after, y, name="after", placement="worker"))
        return b.build()


# -- results and errors --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_results_of_inline_worker_and_async_kernels(backend: str) -> None:
    async def body() -> None:
        async with Executor(mixed_graph()) as ex:
            for i in range(5):
                x = torch.full((4,), float(i))
                torch.testing.assert_close(await ex.execute(x), mixed_expected(x))
            stats = ex.statistics()
            assert (stats.completed, stats.failed, stats.cancelled) == (5, 0, 0)
            assert stats.workers.items_run >= 5, "the worker node did not run on a worker"

    run(body, backend)


@pytest.mark.timeout(60)
def test_an_exported_program(backend: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    program = torch.export.export(model.eval(), (x,))

    async def body() -> None:
        async with Executor(program) as ex:
            for _ in range(3):
                torch.testing.assert_close(await ex.execute(x), model(x))

    run(body, backend)


@pytest.mark.parametrize("placement", ["inline", "worker", "async"])
@pytest.mark.timeout(60)
def test_a_kernel_error_names_its_node(backend: str, placement: str) -> None:
    def bad(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")

    async def bad_async(x: torch.Tensor) -> torch.Tensor:
        await anyio.lowlevel.checkpoint()
        raise ValueError("bad input")

    b = GraphBuilder()
    x = b.input("x")
    if placement == "async":
        b.output(b.call(bad_async, b.call(add_one, x), name="broken"))
    else:
        b.output(b.call(bad, b.call(add_one, x), name="broken", placement=placement))

    async def body() -> None:
        async with Executor(b.build()) as ex:
            with pytest.raises(ValueError, match="bad input") as info:
                await ex.execute(torch.ones(2))
            assert any("%broken" in note for note in info.value.__notes__)
            assert ex.statistics().failed == 1
            assert ex.statistics().frames.in_use == 0

    run(body, backend)


# -- cancellation --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_cancel_scope_waits_for_the_blocked_worker_then_reraises(backend: str) -> None:
    """Cancelled while a worker blocks: the execution neither returns nor releases its frame
    until the thread is done; then the cancellation propagates to its scope, and the late
    result is dropped (the next node never runs)."""
    blocker = Blocker()

    async def body() -> None:
        config = ExecutorConfig(max_concurrent_executions=1, max_parallel_ops=2)
        async with Executor(blocker.graph(), config) as ex:
            scope = anyio.CancelScope()
            returned: list[str] = []

            async def call() -> None:
                with scope:
                    await ex.execute(torch.ones(3))
                    returned.append("value")
                returned.append("scope exited")

            async with anyio.create_task_group() as group:
                group.start_soon(call)
                await until(blocker.entered.is_set, "the worker never started")
                scope.cancel()
                await settle(20)
                assert returned == [], "the execution ended while its worker held the frame"
                assert ex.statistics().frames.in_use == 1
                blocker.release()
            assert returned == ["scope exited"] and scope.cancelled_caught
            assert blocker.log == ["blocked", "released"], "the late result was passed on"
            stats = ex.statistics()
            assert (stats.cancelled, stats.completed, stats.frames.in_use) == (1, 0, 0)
            out = await ex.execute(torch.ones(3))  # the frame is reusable
            torch.testing.assert_close(out, torch.full((3,), 3.0))

    run(body, backend)


class SpinChain:
    """Eight 0.4 ms CPU units without placement hints (adaptive placement may move them), the
    threads they ran on, and a gate that the first unit off `home` waits at when `hold`
    (`held_x`: its input, which tells the executions apart)."""

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.home = threading.get_ident()
        self.hold = False
        self.held_x: int | None = None
        self.held = threading.Event()
        self.gate = threading.Event()

    def __call__(self, x: int) -> int:
        me = threading.get_ident()
        if self.hold and me != self.home and not self.held.is_set():
            self.held_x = x
            self.held.set()
            assert self.gate.wait(10)
        self.threads.append(me)
        until = time.perf_counter() + 0.0004
        while time.perf_counter() < until:
            pass
        return x + 1

    def graph(self) -> Graph:
        b = GraphBuilder()
        value = b.input("x")
        for i in range(8):
            value = b.call(self, value, name=f"spin{i}")
        b.output(value)
        return b.build()


@pytest.mark.timeout(60)
@pytest.mark.skipif(usable_cpus() < 2, reason="a straight line goes to a worker only beside "
                    "a CPU for the loop")
def test_an_overlapping_straight_line_on_a_worker_and_its_cancel_scope(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two executions at once: one runs its straight line on the loop, the other as one work
    item of a worker thread; a cancel scope around the worker's waits for its unit, then the
    line stops there and the frame is free."""
    spin = SpinChain()
    stopped = threading.Event()  # the cancellation reached the execution (Scheduler._stop)
    stop = Scheduler._stop

    def signalled_stop(self: Scheduler, frame: Any) -> None:
        stop(self, frame)
        stopped.set()

    monkeypatch.setattr(Scheduler, "_stop", signalled_stop)

    async def body() -> None:
        async with Executor(spin.graph(), ExecutorConfig(profile_executions=1)) as ex:
            for _ in range(3):  # warm-up, profiled, decided: all inline
                assert await ex.execute(0) == 8
            results: list[int] = []

            async def call() -> None:
                results.append(await ex.execute(0))

            spin.threads.clear()
            async with anyio.create_task_group() as group:
                group.start_soon(call)
                group.start_soon(call)
            assert results == [8, 8] and ex.statistics().worker_executions == 1
            assert spin.threads.count(spin.home) == 8 and len(spin.threads) == 16

            spin.threads.clear()
            spin.hold = True
            scopes = {0: anyio.CancelScope(), 100: anyio.CancelScope()}
            ended: dict[int, int] = {}

            async def cancellable(x: int) -> None:
                with scopes[x]:
                    ended[x] = await ex.execute(x)

            async with anyio.create_task_group() as group:
                for x in scopes:
                    group.start_soon(cancellable, x)
                await until(spin.held.is_set, "no straight line reached a worker")
                held = spin.held_x
                assert held in scopes
                scopes[held].cancel()
                # Regression: under a CPU burner the gate opened before the cancellation was
                # delivered, and the line rightly ran one more unit: wait for the stop itself.
                await until(stopped.is_set, "the cancellation never reached the execution")
                assert ex.statistics().frames.in_use >= 1  # the worker still holds one
                spin.gate.set()
            other = 100 - held
            assert scopes[held].cancelled_caught and ended == {other: other + 8}
            stats = ex.statistics()
            assert stats.worker_executions == 2
            assert (stats.cancelled, stats.frames.in_use) == (1, 0)
            assert len(spin.threads) == 8 + 1  # the cancelled line ran its held unit only
            assert await ex.execute(0) == 8

    run(body, backend)


@pytest.mark.timeout(60)
def test_fail_after_while_a_worker_blocks(backend: str) -> None:
    """`fail_after` expires while the worker blocks: TimeoutError only once the thread ended."""
    blocker = Blocker()

    async def body() -> None:
        async with Executor(blocker.graph(), ExecutorConfig(max_parallel_ops=1)) as ex:

            async def release_later() -> None:
                await until(blocker.entered.is_set, "the worker never started")
                await anyio.sleep(0.2)  # past the deadline below
                blocker.release()

            async with anyio.create_task_group() as group:
                group.start_soon(release_later)
                with pytest.raises(TimeoutError):
                    with anyio.fail_after(0.05):
                        await ex.execute(torch.ones(2))
                assert blocker.log == ["blocked", "released"], "raised before the thread ended"
            assert ex.statistics().cancelled == 1

    run(body, backend)


@pytest.mark.timeout(60)
def test_move_on_after_cancels_an_async_kernel(backend: str) -> None:
    log: list[str] = []

    async def forever(x: torch.Tensor) -> torch.Tensor:
        log.append("started")
        try:
            await anyio.sleep_forever()
        finally:
            log.append("kernel cancelled")
        return x

    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(add_one, b.call(forever, x, name="forever")))

    async def body() -> None:
        async with Executor(b.build()) as ex:
            with anyio.move_on_after(0.05) as scope:
                await ex.execute(torch.ones(2))
            assert scope.cancelled_caught
            assert log == ["started", "kernel cancelled"]
            assert ex.statistics().cancelled == 1

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_call_made_in_a_cancelled_scope_does_not_run(backend: str) -> None:
    async def body() -> None:
        async with Executor(mixed_graph()) as ex:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await ex.execute(torch.ones(2))
            assert scope.cancelled_caught
            stats = ex.statistics()
            assert stats.completed == 0 and stats.frames.in_use == 0
            if backend == "trio":  # anyio's asyncio scope cancels the task only once it waits
                assert stats.started == 0

    run(body, backend)


# -- aclose(cancel=True) ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_aclose_cancel_cancels_a_running_execution_and_a_frame_waiter(backend: str) -> None:
    """aclose(cancel=True) cancels the execution that holds the frame and the one waiting for
    it; the frame goes back (and aclose returns) only once the blocked worker ended, and the
    next node never runs."""
    blocker = Blocker()

    async def body() -> None:
        config = ExecutorConfig(max_concurrent_executions=1, max_parallel_ops=2)
        ex = Executor(blocker.graph(), config)
        outcomes: dict[str, str] = {}
        closed: list[str] = []

        async def close() -> None:
            await ex.aclose(cancel=True)
            closed.append("closed")

        async with anyio.create_task_group() as group:
            group.start_soon(outcome_of, ex.execute(torch.ones(2)), outcomes, "running")
            await until(blocker.entered.is_set, "the worker never started")
            group.start_soon(outcome_of, ex.execute(torch.ones(2)), outcomes, "waiting")
            await until(lambda: _waiters(ex) == 1, "the second call never waited")
            group.start_soon(close)
            await until(lambda: "waiting" in outcomes, "the frame waiter was not cancelled")
            await settle(20)
            assert "running" not in outcomes and closed == [], "ended while its worker ran"
            assert ex.statistics().frames.in_use == 1
            blocker.release()
        expected = closed_by_cancel(backend)
        assert outcomes == {"running": expected, "waiting": expected}
        assert blocker.log == ["blocked", "released"], "the next node ran after aclose"
        stats = ex.statistics()
        assert (stats.cancelled, stats.completed, stats.frames.in_use) == (1, 0, 0)
        assert stats.frames.waiters == 0 and stats.closed

    run(body, backend)


@pytest.mark.parametrize("backend", ["trio"])
@pytest.mark.timeout(60)
def test_the_callers_own_cancel_scope_wins_over_aclose_cancel(backend: str) -> None:
    """Cancelled by its own scope and by aclose(cancel=True) at once, the caller sees its own
    cancellation (its scope catches it), not ExecutorClosedError."""
    blocker = Blocker()

    async def body() -> None:
        ex = Executor(blocker.graph(), ExecutorConfig(max_parallel_ops=2))
        scope = anyio.CancelScope()
        escaped: list[BaseException] = []

        async def call() -> None:
            try:
                with scope:
                    await ex.execute(torch.ones(2))
            except BaseException as exc:
                escaped.append(exc)

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            await until(blocker.entered.is_set, "the worker never started")
            group.start_soon(functools.partial(ex.aclose, cancel=True))
            await settle(5)
            scope.cancel()
            await settle(5)
            blocker.release()
        assert escaped == [] and scope.cancelled_caught
        assert ex.statistics().cancelled == 1

    run(body, backend)


# -- the frame pool ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_frame_pool_under_contention_with_cancelled_waiters(backend: str) -> None:
    """40 callers on 2 frames, every fifth cancelled while it waits or runs: every other
    caller gets its own result, at most 2 frames exist, and none is left in use."""

    async def body() -> None:
        config = ExecutorConfig(max_concurrent_executions=2, max_parallel_ops=2)
        async with Executor(mixed_graph(), config) as ex:
            results: dict[int, torch.Tensor] = {}

            async def call(i: int) -> None:
                with anyio.CancelScope() as scope:
                    if i % 5 == 0:
                        scope.cancel()  # at its first checkpoint: waiting or running
                    results[i] = await ex.execute(torch.full((2,), float(i)))

            async with anyio.create_task_group() as group:
                for i in range(40):
                    group.start_soon(call, i)
            for i, out in results.items():
                torch.testing.assert_close(out, mixed_expected(torch.full((2,), float(i))))
            assert set(results) >= {i for i in range(40) if i % 5}
            stats = ex.statistics()
            assert stats.frames.high_water <= 2 and stats.frames.in_use == 0
            assert stats.frames.waiters == 0

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_waiter_cancelled_while_it_waits_leaves_the_queue(backend: str) -> None:
    blocker = Blocker()

    async def body() -> None:
        config = ExecutorConfig(max_concurrent_executions=1, max_parallel_ops=1)
        async with Executor(blocker.graph(), config) as ex:
            async with anyio.create_task_group() as group:
                group.start_soon(ex.execute, torch.ones(1))
                await until(blocker.entered.is_set, "the worker never started")
                with anyio.CancelScope() as waiting:
                    group.start_soon(_cancel_when, waiting, lambda: _waiters(ex) == 1)
                    await ex.execute(torch.ones(1))
                assert waiting.cancelled_caught
                assert ex.statistics().frames.waiters == 0
                blocker.release()
            assert ex.statistics().completed == 1

    run(body, backend)


def _waiters(ex: Executor) -> int:
    return ex.statistics().frames.waiters


async def _cancel_when(scope: anyio.CancelScope, condition: Callable[[], bool]) -> None:
    await until(condition, "the condition never held")
    scope.cancel()


# -- batching ------------------------------------------------------------------------------


class Rows(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


@pytest.mark.timeout(120)
def test_batching_stacks_concurrent_requests(backend: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(
            Rows().eval(), (torch.ones(2, 3),),
            dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}},
        )

    async def body() -> None:
        config = ExecutorConfig(batching=BatchingConfig(max_batch_size=16))
        async with Executor(program, config) as ex:
            results: dict[int, torch.Tensor] = {}

            async def call(i: int) -> None:
                results[i] = await ex.execute(torch.full((1, 3), float(i)))

            async with anyio.create_task_group() as group:
                for i in range(24):
                    group.start_soon(call, i)
            for i in range(24):
                torch.testing.assert_close(results[i], torch.full((1, 3), 2.0 * i + 1))
            stats = ex.batching_statistics()
            assert stats is not None and stats.requests == 24
            assert stats.batches < 24, "no two requests shared a batch"

    run(body, backend)


def batched_rows_with_a_gate(**batching: Any) -> tuple[Executor, Any]:
    """Rows with batching, every node on a worker, `mul` blocked behind a gate."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(
            Rows().eval(), (torch.ones(2, 3),),
            dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}},
        )
    faults = FaultInjector()
    gate = faults.block("mul")
    config = ExecutorConfig(
        heavy_op_flops=0, adaptive_placement=False, batching=BatchingConfig(**batching)
    )
    return Executor(program, config, kernel_factory=faults.kernel_factory()), gate


@pytest.mark.timeout(60)
def test_aclose_cancel_ends_running_and_queued_batched_requests(backend: str) -> None:
    """A request in a running batch and one still queued, both cancelled by the runtime
    (aclose(cancel=True)): on trio each caller gets ExecutorClosedError, never
    concurrent.futures.CancelledError; a caller whose own scope was cancelled meanwhile sees
    its own cancellation."""

    async def body() -> None:
        ex, gate = batched_rows_with_a_gate(max_concurrent_batches=1)
        outcomes: dict[str, str] = {}
        own = anyio.CancelScope()

        async def own_call() -> None:
            with own:
                await ex.execute(torch.ones(1, 3))
            outcomes["own scope"] = "scope caught" if own.cancelled_caught else "no"

        async with anyio.create_task_group() as group:
            group.start_soon(outcome_of, ex.execute(torch.ones(1, 3)), outcomes, "running")
            await until(lambda: gate.entered >= 1, "the batch never started")
            group.start_soon(outcome_of, ex.execute(torch.ones(1, 3)), outcomes, "queued")
            group.start_soon(own_call)
            await until(lambda: _queued(ex) == 2, "the requests never queued")
            own.cancel()
            await until(lambda: "own scope" in outcomes, "the own-scope call did not end")
            group.start_soon(functools.partial(ex.aclose, cancel=True))
            await until(lambda: "queued" in outcomes, "the queued request did not end")
            gate.open()
        expected = closed_by_cancel(backend)
        assert outcomes == {"running": expected, "queued": expected, "own scope": "scope caught"}
        leaked = concurrent.futures.CancelledError.__qualname__
        assert leaked not in outcomes.values()
        assert ex.statistics().frames.in_use == 0

    run(body, backend)


def _queued(ex: Executor) -> int:
    stats = ex.batching_statistics()
    return stats.queued if stats is not None else 0


# -- the loop slice ------------------------------------------------------------------------


def spin(x: int) -> int:
    """An inline kernel that holds the loop thread for 100 us."""
    import time

    end = time.perf_counter() + 1e-4
    while time.perf_counter() < end:
        pass
    return x + 1


@pytest.mark.timeout(60)
def test_many_callers_share_one_slice_per_loop_turn(backend: str) -> None:
    """Slices shorter than a unit: a heartbeat task gets a turn between units, whatever the
    number of callers (without the shared budget all 32 would run between two beats)."""
    b = GraphBuilder()
    v = b.input("x")
    for i in range(4):
        v = b.call(spin, v, name=f"spin{i}", placement="inline")
    b.output(v)
    config = ExecutorConfig(
        max_fused_nodes=1, loop_slice_s=1e-6, adaptive_placement=False,
        max_concurrent_executions=32,
    )

    async def body() -> None:
        beats = 0

        async def heartbeat() -> None:
            nonlocal beats
            while True:
                beats += 1
                await anyio.lowlevel.checkpoint()

        async with Executor(b.build(), config) as ex, anyio.create_task_group() as outer:
            outer.start_soon(heartbeat)
            await settle(2)
            results: dict[int, int] = {}

            async def call(k: int) -> None:
                results[k] = await ex.execute(k)

            before = beats
            async with anyio.create_task_group() as group:
                for k in range(32):
                    group.start_soon(call, k)
            during = beats - before
            outer.cancel_scope.cancel()
        assert results == {k: k + 4 for k in range(32)}
        assert during >= 32 * 4 // 2, f"{during} heartbeat turns for {32 * 4} units"
        budget = loop_budget(current_loop().native, 1.0)
        assert budget.statistics().deferred > 0

    run(body, backend)


# -- the leak check ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_leak_check_finds_a_pending_kernel_task(backend: str) -> None:
    """A runtime task left pending (an async kernel's) fails the leak check on both loops."""

    async def body() -> None:
        loop = current_loop()
        task = loop.create_task(anyio.sleep_forever())
        try:
            with pytest.raises(LeakError, match="task"):
                async with LeakChecker():
                    pass
        finally:
            task.cancel()
        await settle(5)
        assert task.done() and task.cancelled()

    anyio.run(body, backend=backend)


# -- soak ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_with_random_cancellations(backend: str) -> None:
    """Many concurrent executions of the mixed graph, a fifth of them cancelled at a random
    moment: every finished one is right, and nothing is left over."""
    executions = soak(400, minimum=40)
    rng = random.Random(7)
    plans = [(i, rng.random() < 0.2, rng.random() * 0.002) for i in range(executions)]

    async def body() -> None:
        config = ExecutorConfig(max_concurrent_executions=4, max_parallel_ops=2)
        async with Executor(mixed_graph(), config) as ex:
            done: dict[int, torch.Tensor] = {}

            async def call(i: int, cancel: bool, delay: float) -> None:
                with anyio.CancelScope() as scope:
                    if cancel:
                        _cancel_after(scope, delay)
                    done[i] = await ex.execute(torch.full((3,), float(i)))

            limiter = anyio.CapacityLimiter(32)

            async def limited(*args: Any) -> None:
                async with limiter:
                    await call(*args)

            async with anyio.create_task_group() as group:
                for plan in plans:
                    group.start_soon(limited, *plan)
            for i, out in done.items():
                torch.testing.assert_close(out, mixed_expected(torch.full((3,), float(i))))
            assert len(done) >= sum(1 for _, cancel, _ in plans if not cancel)
            stats = ex.statistics()
            assert stats.completed + stats.cancelled == stats.started
            assert stats.frames.in_use == 0 and stats.failed == 0

    run(body, backend)


def _cancel_after(scope: anyio.CancelScope, delay: float) -> None:
    scope.deadline = anyio.current_time() + delay
