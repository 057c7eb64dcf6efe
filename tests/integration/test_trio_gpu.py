"""Programs with CUDA nodes on trio, beside asyncio: the same test bodies on both backends.

The simulated GPU of support/fake_gpu.py (fake in-order streams and events run in a
random interleaving; a kernel that starts before one it reads, or a CPU node that reads a GPU
value before it was written, is reported) drives the real placement, StreamPlan, CudaRuntime,
schedules and scheduler. Each test runs its body with `anyio.run` on "asyncio" (debug mode)
and "trio" (tests/conftest.py's `backend` fixture), inside a leak check, as test_trio.py
does. Nothing here runs on a real GPU: the real-GPU tests are in test_gpu_executor.py and
test_streams.py (skipped without CUDA).

Covered on both: results and GPU ordering, a CPU node awaiting its GPU input while the loop
runs other tasks, concurrent executions, cancellation by a cancel scope while the GPU works
(the frame comes back only after the GPU finished), cancellation during a host wait, a GPU
fault seen by an event, and aclose(cancel=True) with GPU work in flight.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import Executor
from asyncgraph.graph.ir import Graph
from tests.support.backends import closed_by_cancel, outcome_of, run, settle, until
from tests.support.fake_gpu import (
    CudaNodes,
    FakeBackend,
    FaultyBackend,
    Sim,
    ThreadGpu,
    gpu_config,
    gpu_running,
)
from tests.support.gpu_graphs import chain, diamond, host_reader_graph, index, reference, wide


def executor(graph: Graph, gpu: ThreadGpu, backend: FakeBackend | None = None,
             **config: Any) -> Executor:
    return Executor(
        graph,
        gpu_config(**config),
        kernel_factory=CudaNodes(),
        _cuda_backend=backend or FakeBackend(gpu),
    )


async def closed(ex: Executor, gpu: ThreadGpu) -> None:
    """Close `ex` with the GPU running: aclose waits for GPU work in flight."""
    async with gpu_running(gpu):
        await ex.aclose()


# -- results -------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [{}, {"max_fused_nodes": 1}, {"streams": 1}],
                         ids=["fused", "unfused", "one-stream"])
@pytest.mark.timeout(60)
def test_results_follow_the_gpu_order(backend: str, config: dict[str, Any]) -> None:
    """The diamond (two streams, a cross-stream event) and the wide graph (host waits, a
    worker node making a GPU tensor, a fence): right results, no read before a write."""

    async def body() -> None:
        for seed in range(2):
            gpu = ThreadGpu(seed)
            sim = Sim(gpu)
            for graph in (diamond(sim), wide(sim)):
                ex = executor(graph, gpu, **config)
                try:
                    async with gpu_running(gpu):
                        for k in range(3):
                            out = await ex.execute(sim.upload(k))
                            flat = list(out) if isinstance(out, tuple) else [out]
                            got = [getattr(v, "data", v) for v in flat]
                            assert got == reference(graph, k)
                            assert gpu.pending_kernels() == set()
                finally:
                    await closed(ex, gpu)
                assert ex.cuda_runtime is not None and ex.cuda_runtime.pool.in_use == 0
            assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_concurrent_executions_on_the_gpu(backend: str) -> None:
    async def body() -> None:
        gpu = ThreadGpu(seed=5)
        sim = Sim(gpu)
        graph = wide(sim)
        ex = executor(graph, gpu, max_concurrent_executions=4, streams=2)
        results: dict[int, Any] = {}

        async def call(k: int) -> None:
            total, read = await ex.execute(sim.upload(k))
            results[k] = [total.data, read]

        try:
            async with gpu_running(gpu), anyio.create_task_group() as group:
                for k in range(12):
                    group.start_soon(call, k)
        finally:
            await closed(ex, gpu)
        assert results == {k: reference(graph, k) for k in range(12)}
        assert ex.cuda_runtime is not None and len(ex.cuda_runtime.pool.sets) > 1
        assert gpu.errors == []

    run(body, backend)


# -- host waits ------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["inline", "worker"])
@pytest.mark.timeout(60)
def test_a_cpu_node_awaits_its_gpu_input_while_the_loop_runs(
    backend: str, placement: str
) -> None:
    async def body() -> None:
        gpu = ThreadGpu()
        sim = Sim(gpu)
        graph = host_reader_graph(sim, placement)
        ex = executor(graph, gpu)
        assert ex.cuda_runtime is not None
        assert ex.cuda_runtime.needs_host_wait[index(graph, "host_add")]
        results: list[Any] = []

        async def call() -> None:
            results.append(await ex.execute(sim.upload(5)))

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(call)
                await settle(100)  # the loop runs this task while the GPU has run nothing
                assert results == [] and "add_one" not in sim.host_threads
                async with gpu_running(gpu):
                    await until(lambda: bool(results), "the execution never ended")
        finally:
            await closed(ex, gpu)
        assert results == [11] and gpu.errors == []
        on_worker = sim.host_threads["add_one"].startswith("asyncgraph")
        assert on_worker == (placement == "worker")

    run(body, backend)


@pytest.mark.parametrize("when", ["before the host wait", "during the host wait"])
@pytest.mark.timeout(60)
def test_a_gpu_fault_seen_by_an_event_fails_the_execution(backend: str, when: str) -> None:
    async def body() -> None:
        gpu = ThreadGpu()
        sim = Sim(gpu)
        ex = executor(host_reader_graph(sim, "inline"), gpu, backend=FaultyBackend(gpu))
        failures: list[BaseException] = []

        async def call() -> None:
            try:
                await ex.execute(sim.upload(1))
            except RuntimeError as exc:
                failures.append(exc)

        try:
            gpu.fault = when == "before the host wait"  # type: ignore[attr-defined]
            async with anyio.create_task_group() as group:
                group.start_soon(call)
                await anyio.sleep(0.005)  # polling gpu_double's event
                gpu.fault = True  # type: ignore[attr-defined]
            assert len(failures) == 1 and "illegal memory access" in str(failures[0])
            assert ex.statistics().frames.in_use == 0
            gpu.fault = False  # type: ignore[attr-defined]
            async with gpu_running(gpu):  # the executor is still usable
                assert await ex.execute(sim.upload(2)) == 5
        finally:
            await closed(ex, gpu)

    run(body, backend)


# -- cancellation ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_cancel_scope_waits_for_the_gpu_before_the_frame_is_reused(backend: str) -> None:
    """Cancelled once every kernel is enqueued and none has run: the execution ends, and its
    frame goes to the next caller, only after the GPU finished; the scope catches it."""

    async def body() -> None:
        gpu = ThreadGpu()
        sim = Sim(gpu)
        ex = executor(chain(sim), gpu, max_concurrent_executions=1)
        scope = anyio.CancelScope()
        ended: list[str] = []
        second: list[Any] = []

        async def first() -> None:
            try:
                with scope:
                    await ex.execute(sim.upload(0))
                    ended.append("value")
                ended.append("scope exited")
            except BaseException as exc:  # a cancellation that escaped its own scope
                ended.append(f"escaped: {exc!r}")

        async def then() -> None:
            second.append((await ex.execute(sim.upload(10))).data)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(first)
                await until(lambda: len(gpu.pending_kernels()) == 4, "kernels never enqueued")
                scope.cancel()
                await settle(20)
                assert ended == [], "ended while its kernels were in flight"
                assert ex.statistics().frames.in_use == 1
                group.start_soon(then)
                await until(lambda: ex.statistics().frames.waiters == 1, "no waiter")
                await settle(20)
                assert second == [], "the frame was handed on while the GPU used it"
                async with gpu_running(gpu):
                    await until(lambda: bool(second), "the second execution never ended")
        finally:
            await closed(ex, gpu)
        assert ended == ["scope exited"] and scope.cancelled_caught
        assert second == [14]
        stats = ex.statistics()
        assert (stats.cancelled, stats.completed, stats.frames.in_use) == (1, 1, 0)
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_cancel_scope_during_a_host_wait_finishes_the_gpu(backend: str) -> None:
    async def body() -> None:
        gpu = ThreadGpu()
        sim = Sim(gpu)
        ex = executor(host_reader_graph(sim, "inline"), gpu)
        runtime = ex.cuda_runtime
        assert runtime is not None
        scope = anyio.CancelScope()
        try:
            async with anyio.create_task_group() as group:

                async def call() -> None:
                    with scope:
                        await ex.execute(sim.upload(1))

                group.start_soon(call)
                await anyio.sleep(0.01)  # waiting for gpu_double's event
                scope.cancel()
                await settle(20)
                assert runtime.pool.in_use == 1  # the wait is gone; finish() awaits the GPU
                async with gpu_running(gpu):
                    await until(lambda: runtime.pool.in_use == 0, "the GPU never finished")
        finally:
            await closed(ex, gpu)
        assert scope.cancelled_caught and "add_one" not in sim.host_threads
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_aclose_cancel_with_gpu_work_in_flight(backend: str) -> None:
    """aclose(cancel=True) while the kernels are in flight: the caller is cancelled (asyncio)
    or gets ExecutorClosedError (trio) only once the GPU finished, and aclose returns then."""

    async def body() -> None:
        gpu = ThreadGpu()
        sim = Sim(gpu)
        ex = executor(chain(sim), gpu)
        outcomes: dict[str, str] = {}
        closed_at: list[int] = []

        async def close() -> None:
            await ex.aclose(cancel=True)
            closed_at.append(len(gpu.pending_kernels()))

        async with anyio.create_task_group() as group:
            group.start_soon(outcome_of, ex.execute(sim.upload(0)), outcomes, "caller")
            await until(lambda: len(gpu.pending_kernels()) == 4, "kernels never enqueued")
            group.start_soon(close)
            await settle(20)
            assert outcomes == {} and closed_at == [], "ended while the GPU worked"
            async with gpu_running(gpu):
                await until(lambda: bool(closed_at), "aclose never returned")
        assert outcomes == {"caller": closed_by_cancel(backend)}
        assert closed_at == [0]
        assert ex.cuda_runtime is not None and ex.cuda_runtime.pool.in_use == 0
        assert ex.statistics().cancelled == 1 and gpu.errors == []

    run(body, backend)

