"""The Executor with CUDA nodes: end to end on a simulated GPU, and on a real one.

On the simulated GPU (the fake in-order streams and events of support/fake_gpu.py), the graphs are
GraphBuilder graphs whose `gpu*` nodes a KernelFactory marks as CUDA kernels, so the real
placement (STREAM), StreamPlan, CudaRuntime, schedules and scheduler run them. A CUDA node's
callable enqueues a fake kernel on the current stream that needs the kernels which wrote its
inputs; the simulated GPU runs streams in a random interleaving and reports any kernel that
starts before one it reads, and a CPU node reports any GPU value it reads before it was
written. Values are `FakeCudaTensor`s: the data, computed on the host at once, and the kernel
that writes it on the GPU.

The real-GPU tests at the end skip without CUDA.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import textwrap
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder, InputValidationError
from asyncgraph.cuda.device import FrameStreams, move_inputs_to_device
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.runtime.config import CudaConfig
from asyncgraph.runtime.frame import HOST_WAIT
from asyncgraph.runtime.plan import Placement
from asyncgraph.testing import LeakChecker, introspect
from tests.support.fake_gpu import (
    CudaNodes,
    FakeBackend,
    FakeEvent,
    FaultyBackend,
    Sim,
    ThreadGpu,
    gpu_config,
)
from tests.support.gpu_graphs import (
    add,
    add_one,
    chain,
    diamond,
    double,
    host_reader_graph,
    index,
    reference,
    wide,
)
from tests.support.loop_turns import LoopTurns
from tests.support.real_gpu import CUDA, TwoBranches, assert_sanitizer_clean, needs_gpu

pytestmark = pytest.mark.usefixtures("leak_check")



@pytest.fixture
async def leak_check() -> AsyncIterator[LeakChecker]:
    """The leak check; its CUDA reading leaves out what torch caches on its own (cuBLAS
    workspaces, freed blocks awaiting recorded streams: LeakChecker's `_cuda_allocated`)."""
    async with LeakChecker() as checker:
        yield checker


def test_the_cuda_memory_reading_leaves_out_torchs_own_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before reading `memory_allocated`, the checker waits for the GPU, drops the cuBLAS
    workspaces and lets the allocator process the events of freed record_stream'd blocks
    (empty_cache), which a later malloc would otherwise do after the check."""
    from asyncgraph.testing import leaks

    calls: list[str] = []
    monkeypatch.setattr(leaks, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False
    )
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: calls.append("read") or 7)
    assert leaks._cuda_allocated() == 7
    assert calls == ["synchronize", "clear", "empty_cache", "read"]


@pytest.mark.parametrize(
    ("readings", "expected"),
    [([100], None),  # nothing grew: one cheap collection, nothing unfrozen
     ([150, 100], None),  # garbage reaching a frozen object: freed by the full collection
     ([150, 150], "CUDA memory grew by 50 bytes; HOLDERS")],
)
def test_the_cuda_growth_is_read_again_with_nothing_frozen_before_it_counts(
    readings: list[int], expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The suite freezes each module's survivors (tests/conftest.py), and a collection skips
    frozen objects: what grows after the usual collection is read again after a full one
    (frozen objects unfrozen, frozen again after), and only then counts, with what holds the
    CUDA tensors still alive."""
    from asyncgraph.testing import leaks

    class Garbage:
        """A cycle frozen by `gc.freeze()`: only a collection with nothing frozen frees it.
        (`gc.get_freeze_count()` cannot tell: on 3.12 a collection alone makes it nonzero.)"""

    garbage = Garbage()
    garbage.cycle = garbage  # type: ignore[attr-defined]
    garbage_ref = weakref.ref(garbage)
    gc.freeze()
    del garbage
    garbage_alive_at_reading: list[bool] = []

    def read() -> int:
        garbage_alive_at_reading.append(garbage_ref() is not None)
        return readings[len(garbage_alive_at_reading) - 1]

    monkeypatch.setattr(leaks, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(leaks, "_cuda_allocated", read)
    monkeypatch.setattr(leaks, "_cuda_holders", lambda: "HOLDERS")
    assert leaks._cuda_growth(100, 0) == expected
    assert len(garbage_alive_at_reading) == len(readings)
    assert garbage_alive_at_reading[0]  # the usual collection skips what is frozen
    assert not any(garbage_alive_at_reading[1:])  # the full one does not
    assert gc.get_freeze_count() > 0  # frozen again


# =============================================================================================
# The simulated GPU
# =============================================================================================


class EagerEvent(FakeEvent):
    """An event of a GPU that is always idle by the time the host asks: `query` first runs
    everything enqueued."""

    def query(self) -> bool:
        assert isinstance(self.gpu, ThreadGpu)
        self.gpu.drain()
        return super().query()


class EagerBackend(FakeBackend):
    def new_event(self) -> EagerEvent:
        return EagerEvent(self.gpu)


@contextlib.asynccontextmanager
async def gpu_running(gpu: ThreadGpu) -> AsyncIterator[None]:
    """The simulated GPU making progress in the background until the block ends."""
    stop = asyncio.Event()
    task = asyncio.create_task(gpu.run(stop))
    try:
        yield
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def gpu_executor(
    graph: Graph, gpu: ThreadGpu, *, backend: FakeBackend | None = None, **config: Any
) -> AsyncIterator[Executor]:
    """An Executor of `graph` on the simulated GPU, closed with the GPU running: aclose waits
    for executions in flight, which a test that failed while the GPU was paused leaves."""
    ex = Executor(
        graph,
        gpu_config(**config),
        kernel_factory=CudaNodes(),
        _cuda_backend=backend or FakeBackend(gpu),
    )
    try:
        yield ex
    finally:
        async with gpu_running(gpu):
            await ex.aclose()


def fail(x: int) -> int:
    raise ValueError("bad kernel")


# -- graphs ------------------------------------------------------------------------------------


# =============================================================================================
# Results and ordering
# =============================================================================================

CONFIGS = {  # several streams given: auto (the default) puts these light branches on one
    "default": {"adaptive_placement": True, "profile_executions": 1, "streams": 4},
    "unfused": {"max_fused_nodes": 1, "streams": 4},
    "shuffled": {"ready_order_seed": 3, "streams": 4},
    "one-stream": {"streams": 1},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
async def test_diamond_runs_on_two_streams_in_order(
    seed: int, config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = ThreadGpu(seed)
    sim = Sim(gpu)
    graph = diamond(sim)
    protected: list[list[Any]] = []
    protect = FrameStreams.protect_outputs
    monkeypatch.setattr(
        FrameStreams, "protect_outputs",
        lambda self, outputs: (protected.append(list(outputs)), protect(self, outputs))[1],
    )
    async with gpu_running(gpu), gpu_executor(graph, gpu, **CONFIGS[config]) as ex:
        sp = ex.stream_plan
        assert sp is not None and ex.cuda_runtime is not None
        streams = 1 if config == "one-stream" else 2
        assert len(sp.streams_used) == streams
        if streams == 2:  # the second branch waits on the fork's event on the other stream
            assert sp.waits[index(graph, "gpu_right")] == (index(graph, "gpu_src"),)
        for k in range(5):
            out = await ex.execute(sim.upload(k))
            assert out.data == reference(graph, k)[0] == 3 * k + 4
            assert gpu.pending_kernels() == set()  # execute returned after the GPU finished
            assert protected[-1] == [out]
    assert gpu.errors == [], sp.describe()
    assert ex.cuda_runtime.pool.in_use == 0


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
async def test_wide_graph_spreads_over_streams_and_reads_after_writes(
    seed: int, config: str
) -> None:
    gpu = ThreadGpu(seed)
    sim = Sim(gpu)
    graph = wide(sim)
    async with gpu_running(gpu), gpu_executor(graph, gpu, **CONFIGS[config]) as ex:
        sp = ex.stream_plan
        assert sp is not None and ex.cuda_runtime is not None
        assert len(sp.streams_used) == (1 if config == "one-stream" else 4)
        assert ex.cuda_runtime.needs_host_wait[index(graph, "host_read")]
        assert sp.fence[index(graph, "gpu_mix")]
        for k in range(4):
            total, read = await ex.execute(sim.upload(k))
            assert [total.data, read] == reference(graph, k)
            assert gpu.pending_kernels() == set()
    assert gpu.errors == [], sp.describe()
    assert sim.host_threads["add_one"].startswith("asyncgraph")  # the worker node


async def test_a_cpu_node_reading_gpu_values_is_a_unit_of_its_own() -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    b = GraphBuilder()
    x = b.input("x")
    g = b.call(sim.kernel(double), x, name="gpu_a")
    v = b.call(sim.host(add_one), g, name="host_1", placement="inline")
    v = b.call(sim.host(add_one), v, name="host_2", placement="inline")
    v = b.call(sim.host(add_one), v, name="host_3", placement="inline")
    b.output(v)
    async with gpu_running(gpu), gpu_executor(b.build(), gpu) as ex:
        schedule = introspect.schedule(ex, ex.plan.placement, fused=True)
        # host_1 waits for gpu_a: not fused with host_2 and host_3, which need no wait
        assert schedule.nodes == ((0,), (1,), (2, 3))
        assert await ex.execute(sim.upload(4)) == 11
        (frame,) = introspect.idle_frames(ex)
        assert frame.where == (Placement.DEVICE, HOST_WAIT, Placement.INLINE)
        assert frame.gpu is not None and frame.calls[0] is frame.gpu.calls[0]
    assert gpu.errors == []


# =============================================================================================
# Host cost per execution: O(stream changes), not O(nodes)
# =============================================================================================


def cuda_units(ex: Executor) -> list[tuple[int, ...]]:
    """The units of the executor's fused schedule that enqueue on a stream."""
    schedule = introspect.schedule(ex, ex.plan.placement, fused=True)
    return [
        nodes for nodes, where in zip(schedule.nodes, schedule.where, strict=True)
        if where is Placement.DEVICE
    ]


def stream_changes(ex: Executor) -> int:
    """Maximal runs of consecutive CUDA nodes on one stream (what the plan forces), counted
    from the StreamPlan alone: a CUDA node starts a new run when the previous node was not
    a CUDA node or an alias, or when its stream differs from the run's."""
    sp = ex.stream_plan
    assert sp is not None
    runs, key = 0, None
    for i, role in enumerate(sp.roles):
        if role.value == "cuda":
            if key != sp.key(i):
                runs += 1
            key = sp.key(i)
        elif role.value != "alias":
            key = None
    return runs


@pytest.mark.parametrize("length", [4, 24])
async def test_a_chain_on_one_stream_switches_streams_once_per_execution(length: int) -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    backend = FakeBackend(gpu)
    async with gpu_running(gpu), gpu_executor(chain(sim, length), gpu, backend=backend) as ex:
        assert cuda_units(ex) == [tuple(range(length))]  # one unit: one dispatch, one switch
        await ex.execute(sim.upload(0))  # builds the schedule
        before = (backend.switches, backend.enters, backend.host_stream_calls)
        for k in range(3):
            assert (await ex.execute(sim.upload(k))).data == k + length
        per_execution = [
            (after - first) / 3 for after, first in zip(
                (backend.switches, backend.enters, backend.host_stream_calls), before,
                strict=True,
            )
        ]
    # one enter and one leave; the host's streams are asked once per execution (begin)
    assert per_execution == [2, 1, 1]
    assert gpu.errors == []


@pytest.mark.parametrize("streams", [1, 2, 4])
async def test_stream_switches_follow_stream_changes_not_nodes(streams: int) -> None:
    gpu = ThreadGpu(seed=streams)
    sim = Sim(gpu)
    backend = FakeBackend(gpu)
    graph = wide(sim, width=6, depth=5)
    async with gpu_running(gpu), gpu_executor(
        graph, gpu, backend=backend, streams=streams
    ) as ex:
        units = cuda_units(ex)
        cuda_nodes = sum(len(u) for u in units)
        assert len(units) == stream_changes(ex) < cuda_nodes
        await ex.execute(sim.upload(0))
        switches, enters = backend.switches, backend.enters
        for k in range(2):
            total, read = await ex.execute(sim.upload(k))
            assert [total.data, read] == reference(graph, k)
        assert (backend.enters - enters) / 2 == len(units)
        assert (backend.switches - switches) / 2 <= 2 * len(units)
    assert gpu.errors == [], ex.stream_plan.describe() if ex.stream_plan else ""


async def test_a_fused_cuda_run_waits_records_and_protects_in_the_middle() -> None:
    """The diamond's join continues the right branch's stream, so `gpu_right, gpu_join` is one
    run whose second node waits on the left branch's event: the compiled run calls the layer
    there, and record_stream is issued for the left value (made on the other stream)."""
    for seed in range(6):
        gpu = ThreadGpu(seed)
        sim = Sim(gpu)
        backend = FakeBackend(gpu)
        graph = diamond(sim)
        async with gpu_running(gpu), gpu_executor(graph, gpu, backend=backend, streams=4) as ex:
            right, join = index(graph, "gpu_right"), index(graph, "gpu_join")
            assert (right, join) in cuda_units(ex)
            out = await ex.execute(sim.upload(seed))
            assert out.data == 3 * seed + 4
        left_value = [v for v, _ in backend.recorded if v.writer[1] == "double"]
        assert len(left_value) == 1  # the join read the left branch's value
        assert gpu.errors == []


async def test_an_error_inside_a_fused_cuda_run_names_its_node_and_restores_the_stream() -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    b = GraphBuilder()
    v = b.call(sim.kernel(add_one), b.input("x"), name="gpu_a")
    v = b.call(sim.kernel(fail), v, name="gpu_bad")
    b.output(b.call(sim.kernel(add_one), v, name="gpu_c"))
    async with gpu_running(gpu), gpu_executor(b.build(), gpu) as ex:
        assert cuda_units(ex) == [(0, 1, 2)]
        with pytest.raises(ValueError, match="bad kernel") as info:
            await ex.execute(sim.upload(1))
        assert any("%gpu_bad" in note for note in info.value.__notes__)
        assert gpu.current is None  # the loop thread's stream is the caller's again
    assert gpu.errors == []


# =============================================================================================
# Host waits
# =============================================================================================


@pytest.mark.parametrize("placement", ["inline", "worker", "task"])
async def test_a_cpu_node_awaits_its_gpu_input_without_blocking_the_loop(placement: str) -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    graph = host_reader_graph(sim, placement)
    async with gpu_executor(graph, gpu) as ex:
        assert ex.cuda_runtime is not None
        assert ex.cuda_runtime.needs_host_wait[index(graph, "host_add")]
        beats = asyncio.Event()

        async def heartbeat() -> None:
            for _ in range(100):
                await asyncio.sleep(0)
            beats.set()
            await asyncio.Event().wait()

        beat = asyncio.create_task(heartbeat())
        execution = asyncio.create_task(ex.execute(sim.upload(5)))
        try:
            await beats.wait()  # the loop runs other tasks while the GPU has run nothing
            assert not execution.done()
            assert "add_one" not in sim.host_threads  # the CPU node has not run
            async with gpu_running(gpu):
                assert await execution == 11
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
    assert gpu.errors == []
    on_worker = sim.host_threads["add_one"].startswith("asyncgraph")
    assert on_worker == (placement == "worker")


@pytest.mark.parametrize("placement", ["inline", "worker", "task"])
async def test_a_cpu_node_whose_gpu_input_is_ready_runs_without_a_wait_task(
    placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits = 0
    wait_host = FrameStreams.wait_host

    async def counting(self: FrameStreams, node: int) -> None:
        nonlocal waits
        waits += 1
        await wait_host(self, node)

    monkeypatch.setattr(FrameStreams, "wait_host", counting)
    gpu = ThreadGpu()
    sim = Sim(gpu)
    graph = host_reader_graph(sim, placement)
    async with gpu_executor(graph, gpu, backend=EagerBackend(gpu)) as ex:
        for k in range(3):
            execution = asyncio.create_task(ex.execute(sim.upload(k)))
            while not execution.done():
                gpu.drain()  # the caller's input and the end-of-stream events
                await asyncio.sleep(0)
            assert execution.result() == 2 * k + 1
    assert waits == 0
    assert gpu.errors == []


# =============================================================================================
# Concurrency, cancellation, errors
# =============================================================================================


async def test_concurrent_executions_each_get_a_stream_set_of_their_own() -> None:
    gpu = ThreadGpu(seed=5)
    sim = Sim(gpu)
    graph = wide(sim)
    config = {"max_concurrent_executions": 4, "streams": 2}
    async with gpu_running(gpu), gpu_executor(graph, gpu, **config) as ex:
        assert ex.cuda_runtime is not None
        pool = ex.cuda_runtime.pool
        acquire = pool.acquire
        shared: list[Any] = []
        in_use: list[int] = []

        def spy() -> Any:
            stream_set = acquire()
            if stream_set.users != 1:
                shared.append(stream_set)
            in_use.append(pool.in_use)
            return stream_set

        pool.acquire = spy  # type: ignore[method-assign]
        inputs = list(range(12))
        outs = await asyncio.gather(*(ex.execute(sim.upload(k)) for k in inputs))
        for (total, read), k in zip(outs, inputs, strict=True):
            assert [total.data, read] == reference(graph, k)
    assert shared == []  # the pool never handed a set to two executions at once
    assert max(in_use) > 1  # executions did overlap
    assert 1 < len(pool.sets) <= 4
    streams = [set(map(id, s.streams.values())) for s in pool.sets]
    assert all(not (a & b) for a, b in itertools.combinations(streams, 2))
    assert pool.in_use == 0
    assert gpu.errors == []


async def test_cancellation_waits_for_the_gpu_before_the_frame_is_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    pending_at_begin: list[set[Any]] = []
    begin = FrameStreams.begin

    def recording_begin(self: FrameStreams) -> None:
        pending_at_begin.append(gpu.pending_kernels())
        begin(self)

    monkeypatch.setattr(FrameStreams, "begin", recording_begin)
    async with gpu_executor(chain(sim), gpu, max_concurrent_executions=1) as ex:
        first = asyncio.create_task(ex.execute(sim.upload(0)))
        async with asyncio.timeout(10):  # the first execution builds its schedule on a thread
            while len(gpu.pending_kernels()) < 4:  # noqa: ASYNC110 (polls the simulated GPU)
                await asyncio.sleep(0.001)
        assert len(gpu.pending_kernels()) == 4  # all enqueued; finish() awaits the GPU
        first.cancel()
        await asyncio.sleep(0.01)
        assert not first.done()  # still waiting for the GPU, cancellation absorbed
        assert ex.statistics().frames.in_use == 1
        second = asyncio.create_task(ex.execute(sim.upload(10)))
        await asyncio.sleep(0.01)
        assert ex.statistics().frames.waiters == 1  # the only frame is not handed on early
        first.cancel()  # a second cancellation is absorbed too
        await asyncio.sleep(0.01)
        assert not first.done()
        async with gpu_running(gpu):
            with pytest.raises(asyncio.CancelledError):
                await first
            assert (await second).data == 14
        assert ex.statistics().cancelled == 1
    assert pending_at_begin == [set(), set()]  # the second began after the first's GPU work
    assert gpu.errors == []


async def test_cancellation_during_a_host_wait_cancels_it_and_finishes_the_gpu() -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    async with gpu_executor(host_reader_graph(sim, "inline"), gpu) as ex:
        assert ex.cuda_runtime is not None
        execution = asyncio.create_task(ex.execute(sim.upload(1)))
        await asyncio.sleep(0.01)  # waiting for gpu_double's event
        execution.cancel()
        await asyncio.sleep(0.01)
        assert not execution.done()  # the host-wait task is gone; finish() awaits the GPU
        assert ex.cuda_runtime.pool.in_use == 1
        async with gpu_running(gpu):
            with pytest.raises(asyncio.CancelledError):
                await execution
        assert ex.cuda_runtime.pool.in_use == 0
    assert "add_one" not in sim.host_threads  # the CPU node never ran
    assert gpu.errors == []


async def test_an_error_in_a_cuda_node_stops_the_execution_after_the_gpu_finished() -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(sim.kernel(add_one), x, name="gpu_a")
    bad = b.call(sim.kernel(fail), a, name="gpu_bad")
    c = b.call(sim.kernel(double), x, name="gpu_c")
    seen = b.call(sim.host(add_one), c, name="host_seen", placement="inline")
    b.output(b.call(sim.kernel(add), bad, seen, name="gpu_join"))
    graph = b.build()
    async with gpu_executor(graph, gpu) as ex:
        assert ex.cuda_runtime is not None
        execution = asyncio.create_task(ex.execute(sim.upload(1)))
        await asyncio.sleep(0.01)
        assert not execution.done()  # failed, but gpu_a's kernel is still in flight
        assert gpu.pending_kernels()
        async with gpu_running(gpu):
            with pytest.raises(ValueError, match="bad kernel") as info:
                await execution
            assert any("%gpu_bad" in note for note in info.value.__notes__)
            assert gpu.pending_kernels() == set()
            assert ex.cuda_runtime.pool.in_use == 0
            stats = ex.statistics()
            assert (stats.failed, stats.frames.in_use) == (1, 0)
            # the frame is reusable: the next execution fails the same way
            with pytest.raises(ValueError, match="bad kernel"):
                await ex.execute(sim.upload(2))
    assert not any(k[1] == "add" for k in gpu.launched if k[0] == "k")  # gpu_join never ran
    assert gpu.errors == []


@pytest.mark.parametrize("when", ["before the host wait", "during the host wait"])
async def test_a_gpu_fault_seen_by_an_event_fails_the_execution(when: str) -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    graph = host_reader_graph(sim, "inline")
    async with gpu_executor(graph, gpu, backend=FaultyBackend(gpu)) as ex:
        assert ex.cuda_runtime is not None
        gpu.fault = True  # type: ignore[attr-defined]
        if when == "before the host wait":
            execution = asyncio.create_task(ex.execute(sim.upload(1)))
        else:
            gpu.fault = False  # type: ignore[attr-defined]
            execution = asyncio.create_task(ex.execute(sim.upload(1)))
            await asyncio.sleep(0.005)  # polling gpu_double's event
            gpu.fault = True  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await execution
        assert ex.cuda_runtime.pool.in_use == 0
        assert ex.statistics().frames.in_use == 0
        gpu.fault = False  # type: ignore[attr-defined]
        async with gpu_running(gpu):  # the executor is still usable
            assert await ex.execute(sim.upload(2)) == 5
    assert "add_one" in sim.host_threads


# =============================================================================================
# Configuration and inputs
# =============================================================================================


def test_cuda_streams_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match=r"streams must be >= 1 .*got 0"):
        CudaConfig(streams=0)


async def test_a_cpu_program_builds_no_gpu_state() -> None:
    b = GraphBuilder()
    b.output(b.call(add_one, b.input("x"), name="cpu_only", placement="inline"))
    async with Executor(b.build(), ExecutorConfig(cuda=CudaConfig(streams=2))) as ex:
        assert await ex.execute(1) == 2
        assert ex.stream_plan is None and ex.cuda_runtime is None
        (frame,) = introspect.idle_frames(ex)
        assert frame.gpu is None
        assert frame.calls is frame.schedule.calls  # type: ignore[union-attr]
    assert CUDA or not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]


def device_program(device: str) -> Graph:
    """`x -> x.device.type`, for a tensor input the program expects on `device`."""
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(lambda t: t.device.type, x, name="where", placement="inline"))
    graph = b.build()
    graph.values[x.id].spec = TensorSpec(torch.float32, torch.device(device), (2,), (2,))
    return graph


async def test_without_move_inputs_a_wrong_device_names_the_input_and_both_devices() -> None:
    async with Executor(device_program("cuda:0")) as ex:
        with pytest.raises(InputValidationError) as info:
            await ex.execute(torch.ones(2))
        assert str(info.value) == "x.device: expected cuda:0, got cpu"
        assert ex.statistics().started == 0


async def test_move_inputs_to_device_moves_before_validation() -> None:
    # on a machine without a GPU, the meta device stands in for a CUDA device
    config = ExecutorConfig(move_inputs_to_device=True)
    async with Executor(device_program("meta"), config) as ex:
        assert await ex.execute(torch.ones(2)) == "meta"
        assert await ex.execute(torch.ones(2, device="meta")) == "meta"


async def test_moved_inputs_are_not_what_input_mutations_write_back_to() -> None:
    """An input the program mutates is copied back into the caller's tensor, not the copy."""

    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)
            return x + 1

    ep = torch.export.export(Scale(), (torch.ones(2),))
    config = ExecutorConfig(move_inputs_to_device=True)
    async with Executor(ep, config) as ex:
        x = torch.ones(2)
        out = await ex.execute(x)
        torch.testing.assert_close(out, torch.full((2,), 3.0))
        torch.testing.assert_close(x, torch.full((2,), 2.0))


def test_move_inputs_to_device_blocks_only_for_copies_to_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, bool]] = []

    def fake_to(self: torch.Tensor, device: torch.device, non_blocking: bool = False) -> Any:
        calls.append((str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    spec = TensorSpec(torch.float32, torch.device("cuda", 0), (2,), (2,))
    cpu_spec = TensorSpec(torch.float32, torch.device("cpu"), (2,), (2,))
    move_inputs_to_device([torch.ones(2), torch.ones(2, device="meta")], [spec, cpu_spec])
    assert calls == [("cuda:0", True), ("cpu", False)]


# =============================================================================================
# Real GPUs (skipped without one)
# =============================================================================================


@needs_gpu
@pytest.mark.parametrize("streams", [1, 4])
async def test_gpu_exported_model_matches_eager(streams: int) -> None:
    torch.manual_seed(0)
    model = TwoBranches().cuda().eval()
    ep = torch.export.export(model, (torch.randn(16, 64, device="cuda"),))
    config = ExecutorConfig(cuda=CudaConfig(streams=streams), max_concurrent_executions=4)
    async with Executor(ep, config) as ex:
        assert ex.stream_plan is not None
        used = len(ex.stream_plan.streams_used)
        assert used == 1 if streams == 1 else used >= 2  # the two branches on two streams
        xs = [torch.randn(16, 64, device="cuda") for _ in range(8)]
        outs = await asyncio.gather(*(ex.execute(x) for x in xs))
        with torch.no_grad():
            for out, x in zip(outs, xs, strict=True):
                torch.testing.assert_close(out, model(x))
        # a CPU input is rejected, or moved when asked to
        with pytest.raises(InputValidationError, match=r"^x\.device: expected cuda"):
            await ex.execute(xs[0].cpu())
    moving = ExecutorConfig(cuda=CudaConfig(streams=streams), move_inputs_to_device=True)
    async with Executor(ep, moving) as ex:
        out = await ex.execute(xs[0].cpu())
        with torch.no_grad():
            torch.testing.assert_close(out, model(xs[0]))


def _sleep_kernel(cycles: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def spin(x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        return x + 1

    return spin


@needs_gpu
async def test_gpu_cpu_node_awaits_a_slow_kernel_while_the_loop_runs() -> None:
    def to_host(x: torch.Tensor) -> torch.Tensor:
        return x.cpu() * 10

    b = GraphBuilder()
    x = b.input("x")
    g = b.call(_sleep_kernel(100_000_000), x, name="gpu_spin")
    b.output(b.call(to_host, g, name="host_read", placement="inline"))
    async with Executor(b.build(), kernel_factory=CudaNodes()) as ex:
        async with LoopTurns(0.001) as turns:
            start = time.perf_counter()
            out = await ex.execute(torch.zeros(4, device="cuda"))
            elapsed = time.perf_counter() - start
        assert out.tolist() == [10.0] * 4
        assert turns.count > elapsed * 1000 / 4  # about one tick per ms of GPU time


@needs_gpu
async def test_gpu_cancellation_returns_only_after_the_kernels() -> None:
    b = GraphBuilder()
    x = b.input("x")
    tails = [b.call(_sleep_kernel(200_000_000), x, name=f"gpu_{i}") for i in range(2)]
    b.output(b.call(lambda p, q: p + q, *tails, name="gpu_sum"))
    async with Executor(b.build(), kernel_factory=CudaNodes()) as ex:
        assert ex.cuda_runtime is not None
        task = asyncio.create_task(ex.execute(torch.zeros(4, device="cuda")))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ex.cuda_runtime.pool.in_use == 0
        for stream_set in ex.cuda_runtime.pool.sets:
            assert all(s.query() for s in stream_set.streams.values())  # type: ignore[attr-defined]


_SANITIZER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, torch
    sys.path.insert(0, {root!r})
    from asyncgraph import Executor, ExecutorConfig

    async def main():
        ep = torch.export.load({program!r})
        x = torch.randn(16, 64, device="cuda")
        async with Executor(ep, ExecutorConfig(cuda=CudaConfig(streams=4))) as ex:
            outs = await asyncio.gather(*(ex.execute(x) for _ in range(4)))
            for out in outs:
                out.sum().item()

    asyncio.run(main())
    print("ok")
    """
)


@needs_gpu
@pytest.mark.timeout(600)
def test_gpu_executor_under_the_cuda_sanitizer() -> None:
    assert_sanitizer_clean(_SANITIZER_SCRIPT, "TwoBranches", (16, 64))


@pytest.mark.timeout(300)
def test_gpu_check_collects_the_gpu_tests_from_any_directory(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/gpu_check.py ran pytest in its own process, with examples/ first on sys.path,
    and collection failed on `import tests...`; its subprocess collects them wherever it is
    started from."""
    import importlib.util
    import pathlib
    import subprocess

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.chdir(tmp_path)
    command = gpu_check.gpu_tests_command("--collect-only")
    proc = subprocess.run(
        command, cwd=gpu_check.ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test_gpu_executor_under_the_cuda_sanitizer" in proc.stdout
    assert "errors during collection" not in proc.stdout
