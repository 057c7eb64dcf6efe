"""GPU streams (CUDA execution): the cuda layer on a simulated GPU, and on real GPUs.

Two parts (the pure stream plan it runs is tested in tests/unit/test_stream_plan.py):

1. The cuda layer (`asyncgraph.cuda.device`) driven with fake streams and events over a simulated
   GPU (support/fake_gpu.py) that runs each stream in order, honours `wait_event`, and
   interleaves streams at random. A hypothesis test runs random graphs, concurrently and with
   several executions at once, and checks every kernel starts after the kernels whose values it
   reads, every host read comes after the GPU wrote the value, record_stream is issued for
   every cross-stream tensor, and `finish` returns only when all of an execution's GPU work is
   done.
2. Real-GPU tests, skipped without CUDA: results equal eager on 1 and several streams,
   branches overlap, the loop stays responsive, mixed CPU/GPU graphs, cancellation, and a
   TORCH_CUDA_SANITIZER run.

The same layer run by the Executor's scheduler is tested in test_gpu_executor.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import textwrap
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgraph.cuda.device import (
    CudaRuntime,
    FrameStreams,
    PollPolicy,
    StreamPool,
    TorchCudaBackend,
    move_inputs_to_device,
    run_in_order,
    wait_events,
)
from asyncgraph.cuda.streams import Role, StreamPlan, plan_streams, stream_plan_for
from asyncgraph.graph.builder import GraphBuilder
from asyncgraph.graph.ir import TensorSpec
from asyncgraph.kernels import KernelFactory
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.plan import ExecutionPlan, Placement, build_plan
from tests.support.fake_gpu import FakeBackend, FakeEvent, FakeGpu, FakeStream, RecordingCuda
from tests.support.loop_turns import LoopTurns
from tests.support.real_gpu import (
    CUDA,
    Branches,
    assert_sanitizer_clean,
    export_in_subprocess,
    gpu_program,
    needs_gpu,
    run_gpu,
)

C, A, M, S, H = Role.CUDA, Role.ALIAS, Role.META, Role.SCALAR, Role.HOST

FAST = PollPolicy(spin_s=0.0, max_delay_s=0.0)


# =============================================================================================
# 1. The cuda layer on a simulated GPU (support/fake_gpu.py)
# =============================================================================================


class Oracle:
    """What the GPU semantics require, computed without the planner."""

    def __init__(self, producers: list[list[int]], roles: list[Role]) -> None:
        self.producers = producers
        self.roles = roles
        n = len(roles)
        self.origins: list[set[int]] = []
        self.host_made: list[set[int]] = []
        for i in range(n):
            if roles[i] is C:
                o, h = {i}, set()
            elif roles[i] is A:
                o = set().union(*(self.origins[p] for p in producers[i]))
                h = set().union(*(self.host_made[p] for p in producers[i]))
            elif roles[i] is H:
                o, h = set(), {i}
            else:
                o, h = set(), set()
            self.origins.append(o)
            self.host_made.append(h)

    def read_origins(self, i: int) -> set[int]:
        return set().union(*(self.origins[p] for p in self.producers[i]))

    def read_host_made(self, i: int) -> set[int]:
        return set().union(*(self.host_made[p] for p in self.producers[i]))


class SimGraph:
    """A random graph's node calls for the simulated GPU; values[n] holds the execution id."""

    def __init__(
        self,
        producers: list[list[int]],
        roles: list[Role],
        devices: dict[int, int],
        gpu: FakeGpu,
        num_devices: int,
    ) -> None:
        self.producers = producers
        self.roles = roles
        self.devices = devices
        self.gpu = gpu
        self.num_devices = num_devices
        self.oracle = Oracle(producers, roles)
        self.n = len(roles)
        self.calls = [self._call(i) for i in range(self.n)]

    def _call(self, i: int) -> Any:
        gpu, oracle, role, n = self.gpu, self.oracle, self.roles[i], self.n

        def call(values: list[Any]) -> Any:
            ex = values[n]
            if role is C:
                dev = self.devices.get(i, 0)
                needs: set[tuple[Any, ...]] = {("k", ex, o) for o in oracle.read_origins(i)}
                needs |= {("h", ex, h, dev) for h in oracle.read_host_made(i)}
                needs.add(("in", ex, dev))
                gpu.launch(("k", ex, i), needs)
            elif role in (S, H):
                missing = {("k", ex, o) for o in oracle.read_origins(i)} - gpu.done_kernels
                if missing:
                    gpu.errors.append(f"host node {i} read {sorted(map(str, missing))} early")
                if role is H:  # a host kernel that makes a GPU tensor on every device
                    for d in range(self.num_devices):
                        gpu.launch(("h", ex, i, d), set(), gpu.default[d])
            return (ex, i)

        return call

    def expected_record_stream(self, plan: StreamPlan, i: int) -> set[int]:
        key = plan.key(i)
        return {
            p for p in self.producers[i]
            if any(plan.key(o) != key for o in self.oracle.origins[p])
        }


async def simulate(
    sim: SimGraph,
    gpu_state: FrameStreams,
    ex: int,
    backend: FakeBackend,
    rng: random.Random,
    outputs: Sequence[int],
) -> None:
    """One execution, driven like the scheduler: each node runs when its producers have,
    host nodes await their events, ready nodes interleave at random."""
    gpu = sim.gpu
    n = sim.n
    for d in range(sim.num_devices):  # the caller's inputs, still being written
        gpu.launch(("in", ex, d), set(), gpu.default[d])
    values: list[Any] = [None] * n + [ex]
    done = [asyncio.get_running_loop().create_future() for _ in range(n)]
    runtime = gpu_state.runtime

    async def node(i: int) -> None:
        for p in sim.producers[i]:
            await done[p]
        for _ in range(rng.randint(0, 2)):
            await asyncio.sleep(0)
        if runtime.needs_host_wait[i] and not gpu_state.host_ready(i):
            await gpu_state.wait_host(i)
        values[i] = gpu_state.calls[i](values)
        done[i].set_result(None)

    gpu_state.begin()
    stream_set = gpu_state.stream_set
    assert stream_set is not None
    try:
        await asyncio.gather(*(node(i) for i in range(n)))
        await gpu_state.wait_outputs()
        for o in outputs:
            for origin in sim.oracle.origins[o]:
                assert ("k", ex, origin) in gpu.done_kernels, f"output {o} not ready"
    finally:
        await gpu_state.finish()
    mine = {k for k in gpu.launched if k[0] == "k" and k[1] == ex}  # on the executor's streams
    assert mine <= gpu.done_kernels, gpu.errors or "finish() returned with GPU work in flight"
    plan = runtime.plan
    recorded = {(v, s) for v, s in backend.recorded if v[0] == ex}
    expected = {
        ((ex, p), stream_set.by_node[i])
        for i in plan.cuda_nodes
        for p in sim.expected_record_stream(plan, i)
    }
    assert recorded == expected


roles_st = st.sampled_from([C, C, C, A, M, S, H])


@st.composite
def random_graphs(draw: st.DrawFn) -> tuple[list[list[int]], list[Role], dict[int, int], int]:
    n = draw(st.integers(1, 14))
    num_devices = draw(st.integers(1, 2))
    producers: list[list[int]] = []
    roles: list[Role] = []
    devices: dict[int, int] = {}
    for i in range(n):
        k = draw(st.integers(0, min(i, 3)))
        producers.append(sorted(draw(st.sets(st.integers(0, i - 1), min_size=k, max_size=k)))
                         if i else [])
        roles.append(draw(roles_st))
        devices[i] = draw(st.integers(0, num_devices - 1))
    return producers, roles, devices, num_devices


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=random_graphs(),
    streams=st.integers(1, 4),
    executions=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_random_graphs_on_a_simulated_gpu(
    graph: tuple[list[list[int]], list[Role], dict[int, int], int],
    streams: int,
    executions: int,
    seed: int,
) -> None:
    producers, roles, devices, num_devices = graph
    outputs = sorted({len(roles) - 1, seed % len(roles)})
    plan = plan_streams(producers, roles, streams, devices=devices, outputs=outputs)
    rng = random.Random(seed)

    async def main() -> None:
        gpu = FakeGpu(seed, num_devices)
        backend = FakeBackend(gpu)
        sim = SimGraph(producers, roles, devices, gpu, num_devices)
        runtime = CudaRuntime(
            plan, range(len(roles)), max_stream_sets=2, backend=backend, poll=FAST
        )
        frames = [runtime.frame_state(sim.calls) for _ in range(executions)]
        stop = asyncio.Event()
        gpu_task = asyncio.create_task(gpu.run(stop))

        async def frame_runs(k: int) -> None:  # two executions per frame, frames concurrently
            for rep in range(2):
                await simulate(sim, frames[k], 10 * k + rep, backend, rng, outputs)

        try:  # the GPU keeps running until every execution has finished, failed or not
            async with asyncio.timeout(20), asyncio.TaskGroup() as group:
                for k in range(executions):
                    group.create_task(frame_runs(k))
        finally:
            stop.set()
            await gpu_task
        assert gpu.errors == [], plan.describe()
        assert runtime.pool.in_use == 0
        assert len(runtime.pool.sets) <= 2

    asyncio.run(main())


# -- pool, lease and waits -----------------------------------------------------------------------


def _diamond_runtime(
    gpu: FakeGpu, max_sets: int = 2, streams: int = 2
) -> tuple[CudaRuntime, FakeBackend]:
    plan = plan_streams([[], [0], [0], [1, 2]], [C] * 4, streams, outputs=[3])
    backend = FakeBackend(gpu)
    runtime = CudaRuntime(plan, range(4), max_stream_sets=max_sets, backend=backend, poll=FAST)
    return runtime, backend


def test_pool_gives_concurrent_executions_distinct_stream_sets() -> None:
    gpu = FakeGpu()
    runtime, _ = _diamond_runtime(gpu, max_sets=3)
    pool = runtime.pool
    sets = [pool.acquire() for _ in range(3)]
    streams = [set(map(id, s.streams.values())) for s in sets]
    assert all(len(s) == 2 for s in streams)
    assert not (streams[0] & streams[1]) and not (streams[1] & streams[2])
    assert pool.in_use == 3
    assert len(gpu.streams) == 2 + 6  # two default streams, two per set, created lazily


def test_pool_reuses_idle_sets_before_creating_and_shares_when_exhausted() -> None:
    gpu = FakeGpu()
    runtime, _ = _diamond_runtime(gpu, max_sets=2)
    pool = runtime.pool
    a = pool.acquire()
    pool.release(a)
    assert pool.acquire() is a  # an idle set is reused, no new streams
    b = pool.acquire()
    assert b is not a
    c = pool.acquire()  # exhausted: shares the least-used set
    assert c in (a, b) and c.users == 2
    d = pool.acquire()
    assert d is not c  # the other one now has fewer users
    assert len(pool.sets) == 2
    for s in (a, b, c, d):
        pool.release(s)
    assert pool.in_use == 0
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a)


def test_pool_maps_cuda_nodes_to_their_planned_streams() -> None:
    gpu = FakeGpu()
    runtime, _ = _diamond_runtime(gpu)
    stream_set = runtime.pool.acquire()
    plan = runtime.plan
    for i in plan.cuda_nodes:
        assert stream_set.by_node[i] is stream_set.streams[plan.key(i)]
    with pytest.raises(ValueError, match="max_sets"):
        StreamPool(plan, 0, FakeBackend(gpu))


def test_run_enqueues_waits_kernels_record_stream_and_events_in_order() -> None:
    gpu = FakeGpu()
    runtime, backend = _diamond_runtime(gpu)
    values: list[Any] = [None] * 4

    def kernel(i: int) -> Any:
        def call(v: list[Any]) -> Any:
            gpu.launch(i, set())
            return f"v{i}"

        return call

    state = runtime.frame_state([kernel(i) for i in range(4)])
    with pytest.raises(RuntimeError, match="outside begin"):
        state.calls[0](values)
    state.begin()
    with pytest.raises(RuntimeError, match="twice"):
        state.begin()
    stream_set = state.stream_set
    assert stream_set is not None
    s0: Any = stream_set.streams[(0, 0)]
    s1: Any = stream_set.streams[(0, 1)]
    for i in range(4):
        values[i] = state.calls[i](values)
    # each stream first waits for the caller's stream (begin), then runs its nodes
    assert [op[0] for op in s0.queue] == ["wait", "kernel", "record", "kernel", "record"]
    assert [op[0] for op in s1.queue] == ["wait", "wait", "kernel", "wait", "kernel", "record"]
    assert backend.recorded == [("v0", s1), ("v1", s1)]


async def test_wait_events_polls_without_blocking_then_synchronizes() -> None:
    gpu = FakeGpu()
    stream = gpu.stream("s")
    events = [FakeEvent(gpu) for _ in range(3)]
    for e in events:
        e.record(stream)

    async def gpu_later() -> None:
        await asyncio.sleep(0.005)
        while gpu.step():
            pass

    async with LoopTurns() as turns:
        gpu_task = asyncio.create_task(gpu_later())
        await wait_events(events, PollPolicy(spin_s=1e-4, max_delay_s=1e-3))
    await gpu_task
    assert all(e.query() and e.synchronized == 1 for e in events)
    assert turns.count > 3  # the loop kept running other tasks meanwhile


async def test_wait_events_is_cancellable() -> None:
    gpu = FakeGpu()
    event = FakeEvent(gpu)
    event.record(gpu.stream("s"))  # never runs
    task = asyncio.create_task(wait_events([event], FAST))
    await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert event.synchronized == 0


async def test_finish_waits_for_the_gpu_through_cancellation() -> None:
    gpu = FakeGpu()
    runtime, _ = _diamond_runtime(gpu)

    def kernel(i: int) -> Any:
        return lambda v: gpu.launch(i, set())

    state = runtime.frame_state([kernel(i) for i in range(4)])

    async def execution() -> None:
        await run_in_order(state, [None] * 4)

    task = asyncio.create_task(execution())
    for _ in range(5):
        await asyncio.sleep(0)
    assert runtime.pool.in_use == 1
    task.cancel()  # while finish() waits on a GPU that has not started
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()  # still waiting for the GPU, not abandoning the frame
    assert runtime.pool.in_use == 1
    task.cancel()  # a second cancellation is absorbed as well
    while gpu.step():
        pass
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runtime.pool.in_use == 0
    assert gpu.launched <= gpu.done_kernels


def test_a_fenced_node_waits_on_the_callers_streams_from_any_thread() -> None:
    """The host streams are those of the thread that began the execution: a CUDA node
    enqueued from a worker thread (whose current stream is the default one) still orders
    itself after a host kernel that ran on the caller's stream."""
    gpu = FakeGpu()
    caller = gpu.stream("caller")
    local = threading.local()

    class CallerBackend(FakeBackend):
        def host_streams(self, device: int) -> list[FakeStream]:
            current: FakeStream | None = getattr(local, "stream", None)
            default = self.gpu.default[device]
            return [current, default] if current is not None else [default]

    plan = plan_streams([[], [0]], [H, C], 1)  # a host node, then a CUDA node reading it
    assert plan.fence[1]
    runtime = CudaRuntime(plan, range(2), max_stream_sets=1, backend=CallerBackend(gpu))
    state = runtime.frame_state([lambda v: None, lambda v: None])
    local.stream = caller
    state.begin()
    worker = threading.Thread(target=state.calls[1], args=([None, None],))
    worker.start()
    worker.join()
    # begin's event and the fence's wait_stream were both recorded on the caller's stream
    assert [op[0] for op in caller.queue] == ["record", "record"]


async def test_finish_without_begin_is_a_no_op() -> None:
    runtime, _ = _diamond_runtime(FakeGpu())
    state = runtime.frame_state([lambda v: None] * 4)
    await state.finish()  # returns: no end events to wait for, no stream set to give back
    assert state.stream_set is None and runtime.pool.sets == []


async def test_run_in_order_with_host_nodes_waits_for_their_events() -> None:
    gpu = FakeGpu(seed=3)
    producers = [[], [0], [0], [1, 2], [3]]
    roles = [C, C, C, C, H]
    sim = SimGraph(producers, roles, {}, gpu, 1)
    plan = plan_streams(producers, roles, 2, outputs=[4])
    runtime = CudaRuntime(
        plan, range(5), max_stream_sets=1, backend=FakeBackend(gpu), poll=FAST
    )
    state = runtime.frame_state(sim.calls)
    stop = asyncio.Event()
    gpu_task = asyncio.create_task(gpu.run(stop))
    values: list[Any] = [None] * 5 + [0]
    for d in range(1):
        gpu.launch(("in", 0, d), set(), gpu.default[d])
    try:
        await run_in_order(state, values)
    finally:
        stop.set()
        await gpu_task
    assert gpu.errors == []
    assert values[4] == (0, 4)


def test_cuda_runtime_checks_value_ids() -> None:
    plan = plan_streams([[]], [C], 1)
    with pytest.raises(ValueError, match="value ids"):
        CudaRuntime(plan, [0, 1], max_stream_sets=1, backend=FakeBackend(FakeGpu()))


def test_protect_outputs_records_the_callers_stream_on_gpu_tensors_only() -> None:
    gpu = FakeGpu()
    runtime, backend = _diamond_runtime(gpu)
    state = runtime.frame_state([lambda v: None] * 4)
    state.protect_outputs([torch.ones(2), 3, (torch.zeros(1),)])
    assert backend.recorded == []  # CPU tensors need nothing


@pytest.mark.skipif(CUDA, reason="checks the message on a machine without CUDA")
def test_torch_backend_without_cuda_says_so_plainly() -> None:
    backend = TorchCudaBackend()  # constructing it touches nothing
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
        backend.new_stream(0)


def _forbid_torch_cuda_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python helpers the hot path must not reach (they cost more than a launch)."""
    for name in ("stream", "current_stream", "default_stream", "set_stream", "is_available",
                 "current_device", "_get_device_index"):
        def forbidden(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise AssertionError(f"torch.cuda.{_name} called on the hot path")

        monkeypatch.setattr(torch.cuda, name, forbidden, raising=False)


def test_torch_backend_switches_with_c_functions_only_when_the_stream_differs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_torch_cuda_helpers(monkeypatch)
    cuda = RecordingCuda()
    backend = TorchCudaBackend(cuda.functions())
    stream = types.SimpleNamespace(stream_id=7, device_index=0, device_type=1)
    handle = backend.stream_handle(stream)
    assert handle == (7, 0, 1)
    token = backend.enter_stream(handle)
    assert cuda.current[0] == handle
    inner = backend.enter_stream(handle)  # already current: a read, no switch
    backend.leave_stream(inner)
    assert cuda.current[0] == handle
    backend.leave_stream(token)
    assert cuda.current[0] == (0, 0, 1) and cuda.device == 0
    assert [c[0] for c in cuda.log] == [
        "get_current", "get_device", "set_stream", "get_current", "set_stream",
    ]


def test_torch_backend_restores_the_device_after_a_stream_of_another_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_torch_cuda_helpers(monkeypatch)
    cuda = RecordingCuda()
    backend = TorchCudaBackend(cuda.functions())
    token = backend.enter_stream((9, 1, 1))
    assert (cuda.device, cuda.current[1]) == (1, (9, 1, 1))
    backend.leave_stream(token)
    assert (cuda.device, cuda.current) == (0, {0: (0, 0, 1), 1: (0, 1, 1)})


def test_torch_backend_host_streams_are_cached_stream_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _forbid_torch_cuda_helpers(monkeypatch)
    cuda = RecordingCuda()
    backend = TorchCudaBackend(cuda.functions())
    (default,) = backend.host_streams(0)
    assert (default.stream_id, default.device_index) == (0, 0)
    cuda.current[0] = (5, 0, 1)
    current, again = backend.host_streams(0)
    assert current.stream_id == 5 and again is default  # made once per stream id


def test_move_inputs_to_device_moves_only_mismatched_tensors() -> None:
    cpu = torch.ones(2)
    spec_cpu = TensorSpec(torch.float32, torch.device("cpu"), (2,), (2,))
    spec_meta = TensorSpec(torch.float32, torch.device("meta"), (2,), (2,))
    moved = move_inputs_to_device([cpu, cpu, 5], [spec_cpu, spec_meta, None])
    assert moved[0] is cpu
    assert moved[1].device.type == "meta"
    assert moved[2] == 5


# =============================================================================================
# 2. Real GPUs (skipped without one)
# =============================================================================================


@needs_gpu
@pytest.mark.parametrize("streams", [1, 4])
async def test_gpu_results_equal_eager(streams: int) -> None:
    torch.manual_seed(0)
    model = Branches().cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    ex, runtime = gpu_program(model, x, streams)
    assert len(runtime.plan.streams_used) == min(streams, 4)
    state = runtime.frame_state(ex.plan.calls)
    for _ in range(3):
        x = torch.randn(32, 64, device="cuda")
        (out,) = await run_gpu(ex, state, x)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x))
    await ex.aclose()


@needs_gpu
async def test_gpu_concurrent_executions_use_distinct_streams_and_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overlapping executions get distinct stream sets. Whether executions overlap on their
    own depends on the GPU (a fast one may finish each before the next begins, and then one
    set serves all, as designed), so a barrier in `finish` makes all four hold their sets at
    once before any returns it."""
    torch.manual_seed(0)
    model = Branches().cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    ex, runtime = gpu_program(model, x, streams=2, max_sets=4)
    states = [runtime.frame_state(ex.plan.calls) for _ in range(4)]
    xs = [torch.randn(32, 64, device="cuda") for _ in states]
    all_begun = asyncio.Barrier(len(states))
    finish = FrameStreams.finish

    async def finish_once_all_began(self: FrameStreams, turn: bool = True) -> None:
        await all_begun.wait()
        await finish(self, turn)

    monkeypatch.setattr(FrameStreams, "finish", finish_once_all_began)
    async with asyncio.timeout(60):
        outs = await asyncio.gather(
            *(run_gpu(ex, s, xi) for s, xi in zip(states, xs, strict=True))
        )
    assert len(runtime.pool.sets) == 4
    ids = [set(map(id, s.streams.values())) for s in runtime.pool.sets]
    assert all(not (ids[i] & ids[j]) for i in range(4) for j in range(i))
    with torch.no_grad():
        for (out,), xi in zip(outs, xs, strict=True):
            torch.testing.assert_close(out, model(xi))
    await ex.aclose()


def _sleep_graph(
    cycles: int, branches: int, spin: Callable[[int], Any] | None = None
) -> tuple[Any, ExecutionPlan]:
    """Branches of `torch.cuda._sleep` kernels (`spin(cycles)` makes one), marked STREAM as
    CUDA nodes."""

    def sleep_kernel(x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        return x + 1

    kernel = spin(cycles) if spin is not None else sleep_kernel

    def total(*xs: torch.Tensor) -> torch.Tensor:
        return torch.stack(xs).sum(0)

    b = GraphBuilder()
    x = b.input("x")
    tails = [b.call(kernel, b.call(kernel, x)) for _ in range(branches)]
    b.output(b.call(total, *tails))
    graph = b.build()
    plan = build_plan(graph, KernelFactory().create(graph), ExecutorConfig())
    return graph, dataclasses.replace(plan, placement=(Placement.DEVICE,) * len(graph.nodes))


class GpuIntervals:
    """Timing events around each `_sleep` kernel, on the stream it runs on: GPU-side start
    and end times, so overlap is read from the GPU, not from the host's wall clock."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, Any]] = []

    def spin(self, cycles: int) -> Any:
        def spin(x: torch.Tensor) -> torch.Tensor:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()  # the current stream: the node's
            torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
            end.record()
            self.events.append((start, end))
            return x + 1

        return spin

    def busy(self) -> bool:
        """Whether a recorded kernel has not finished (never waits)."""
        return any(not end.query() for _, end in self.events)

    def overlapping_pairs(self) -> int:
        """Pairs of kernels whose GPU intervals overlap (after the GPU is done)."""
        torch.cuda.synchronize()
        first = self.events[0][0]
        spans = [(first.elapsed_time(s), first.elapsed_time(e)) for s, e in self.events]
        return sum(
            1 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[:i] if a0 < b1 and b0 < a1
        )


@needs_gpu
async def test_gpu_branches_overlap_on_several_streams_and_the_loop_stays_free() -> None:
    """On 4 streams independent branches overlap on the GPU (timing events: GPU time, no
    host wall clock); on 1 they cannot. The loop keeps turning while kernels run: a ticker
    sees the GPU busy on several turns, which a blocked loop could not."""
    cycles = 50_000_000  # tens of milliseconds per kernel on current GPUs
    overlaps = {}
    for streams in (1, 4):
        intervals = GpuIntervals()
        graph, plan = _sleep_graph(cycles, branches=4, spin=intervals.spin)
        sp = stream_plan_for(graph, plan, streams, default_device=torch.cuda.current_device())
        runtime = CudaRuntime(sp, plan.outputs, max_stream_sets=1)
        state = runtime.frame_state(plan.calls)
        values: list[Any] = [None] * plan.num_values
        values[plan.user_input_slots[0]] = torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        busy_turns: list[bool] = []

        async def ticker(
            intervals: GpuIntervals = intervals, busy_turns: list[bool] = busy_turns
        ) -> None:
            while True:
                busy_turns.append(intervals.busy())
                await asyncio.sleep(0.001)

        tick = asyncio.create_task(ticker())
        try:
            await run_in_order(state, values)
        finally:
            tick.cancel()
        assert values[plan.outputs[-1]].tolist() == [8.0] * 4
        assert sum(busy_turns) >= 2
        overlaps[streams] = intervals.overlapping_pairs()
    assert overlaps[1] == 0
    assert overlaps[4] >= 1, overlaps


@needs_gpu
async def test_gpu_mixed_cpu_and_gpu_nodes() -> None:
    def gpu_op(x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
        return x * 2

    def to_host(x: torch.Tensor) -> torch.Tensor:  # a CPU node reading a GPU value
        return x.cpu() + 1

    def back(x: torch.Tensor) -> torch.Tensor:  # a CPU node making a GPU tensor
        return x.to("cuda") * 3

    b = GraphBuilder()
    x = b.input("x")
    g = b.call(gpu_op, x, name="g")
    h = b.call(to_host, g, name="h")
    c = b.call(back, h, name="c")
    out = b.call(gpu_op, c, name="out")
    b.output((h, out))
    graph = b.build()
    plan = build_plan(graph, KernelFactory().create(graph), ExecutorConfig())
    streams_at = {graph.node(n).index for n in ("g", "out")}
    plan = dataclasses.replace(plan, placement=tuple(
        Placement.DEVICE if i in streams_at else p for i, p in enumerate(plan.placement)
    ))
    sp = stream_plan_for(graph, plan, 2, default_device=torch.cuda.current_device())
    assert sp.host_waits[graph.node("h").index] == (graph.node("g").index,)
    runtime = CudaRuntime(sp, plan.outputs, max_stream_sets=1)
    state = runtime.frame_state(plan.calls)
    values: list[Any] = [None] * plan.num_values
    values[plan.user_input_slots[0]] = torch.arange(4.0, device="cuda")
    await run_in_order(state, values)
    assert values[graph.node("h").output].tolist() == [1.0, 3.0, 5.0, 7.0]
    assert values[graph.node("out").output].tolist() == [6.0, 18.0, 30.0, 42.0]


@needs_gpu
async def test_gpu_cancellation_waits_for_kernels_in_flight() -> None:
    graph, plan = _sleep_graph(200_000_000, branches=2)
    sp = stream_plan_for(graph, plan, 2, default_device=torch.cuda.current_device())
    runtime = CudaRuntime(sp, plan.outputs, max_stream_sets=1)
    state = runtime.frame_state(plan.calls)
    values: list[Any] = [None] * plan.num_values
    values[plan.user_input_slots[0]] = torch.zeros(4, device="cuda")
    task = asyncio.create_task(run_in_order(state, values))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runtime.pool.in_use == 0
    (stream_set,) = runtime.pool.sets
    streams: list[Any] = list(stream_set.streams.values())
    assert all(s.query() for s in streams)  # nothing left in flight


_SANITIZER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, torch
    sys.path.insert(0, {root!r})
    from tests.support.real_gpu import gpu_program, run_gpu

    async def main():
        ep = torch.export.load({program!r})
        x = torch.randn(32, 64, device="cuda")
        ex, runtime = gpu_program(ep, x, streams=4)
        state = runtime.frame_state(ex.plan.calls)
        for _ in range(3):
            (out,) = await run_gpu(ex, state, x)
            out.sum().item()
        await ex.aclose()

    asyncio.run(main())
    print("ok")
    """
)


@pytest.mark.timeout(300)
def test_the_sanitizer_runs_export_in_a_process_of_its_own(tmp_path: Any) -> None:
    """The export half of the sanitizer tests, on the CPU: a .pt2 made in a subprocess
    (TORCH_CUDA_SANITIZER removed from its environment) that this process loads and runs."""
    program = str(tmp_path / "program.pt2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_CUDA_SANITIZER", "1")  # must not reach the export
        export_in_subprocess("Branches", (32, 64), "cpu", program)
    ep = torch.export.load(program)
    torch.manual_seed(0)
    model = Branches().eval()
    x = torch.randn(32, 64)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model(x))


@needs_gpu
@pytest.mark.timeout(600)
def test_gpu_sanitizer_finds_no_race() -> None:
    assert_sanitizer_clean(_SANITIZER_SCRIPT, "Branches", (32, 64))
