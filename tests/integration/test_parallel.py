"""Parallel dataflow: real overlap, chains without hops, cancellation, load and weight swaps."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
from typing import Any

import anyio
import pytest
import torch

import asyncgraph
from asyncgraph import ExecutorConfig, GraphBuilder
from asyncgraph.kernels import KernelFactory, OpKernel

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.serial]


def _wide_builder(branches: int, barrier: threading.Barrier) -> asyncgraph.Graph:
    def meet(x: int) -> int:
        barrier.wait()  # passes only if `branches` nodes run at the same time
        return x + 1

    def total(*xs: int) -> int:
        return sum(xs)

    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(total, *[b.call(meet, x, name=f"branch{i}") for i in range(branches)]))
    return b.build()


async def test_independent_branches_run_at_the_same_time() -> None:
    barrier = threading.Barrier(4, timeout=20)
    graph = _wide_builder(4, barrier)
    async with asyncgraph.Executor(graph, ExecutorConfig(max_parallel_ops=4)) as ex:
        assert await ex.execute(1) == 8


class WideMatmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 256, 256) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i in range(4):
            h = x
            for _ in range(4):
                h = h @ self.w[i]
            outs.append(h)
        return sum(outs)  # type: ignore[return-value]


class _MeetingFactory(KernelFactory):
    """The default kernels, with the first `parties` matmul calls meeting at a barrier: they
    pass only if that many matmuls are in flight at once, each on its own thread."""

    def __init__(self, config: ExecutorConfig, parties: int) -> None:
        super().__init__(config)
        self.barrier = threading.Barrier(parties, timeout=20)
        self.met_on: list[str] = []
        self._calls = itertools.count()

    def create(self, graph: asyncgraph.Graph) -> list[OpKernel]:
        kernels = super().create(graph)
        return [
            k.with_fn(self._meeting(k.fn))
            if "matmul" in node.target_name() else k
            for k, node in zip(kernels, graph.nodes, strict=True)
        ]

    def _meeting(self, fn: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            if next(self._calls) < self.barrier.parties:
                self.met_on.append(threading.current_thread().name)
                self.barrier.wait()  # BrokenBarrierError after 20 s: no second matmul came
            return fn(*args, **kwargs)

        return kernel


@pytest.mark.timeout(60)
async def test_exported_branches_run_on_two_workers_at_once() -> None:
    """Two matmuls of the exported program in flight at the same time, on two worker threads.

    A handshake, not a clock: the first two matmul calls wait for each other, which can only
    happen when the scheduler runs two branches at once. (How much faster that makes the
    program is asyncgraph/bench/wide.py's question.)"""
    model = WideMatmul()
    x = torch.randn(256, 256)
    ep = torch.export.export(model, (x,))
    config = ExecutorConfig(max_parallel_ops=2, adaptive_placement=False)
    factory = _MeetingFactory(config, parties=2)
    async with asyncgraph.Executor(ep, config, kernel_factory=factory) as ex:
        placements = ex.placements()
        assert sum(p is asyncgraph.Placement.WORKER for p in placements.values()) >= 16
        out = await ex.execute(x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-3)
    assert len(factory.met_on) == 2 and len(set(factory.met_on)) == 2, factory.met_on
    assert all(name.startswith("asyncgraph-worker") for name in factory.met_on), factory.met_on


async def test_a_chain_stays_on_its_worker() -> None:
    seen: list[str] = []

    def step(x: int) -> int:
        seen.append(threading.current_thread().name)
        return x + 1

    b = GraphBuilder()
    v = b.input("x")
    for i in range(20):
        v = b.call(step, v, name=f"s{i}", placement="worker" if i % 3 else "inline")
    b.output(v)
    async with asyncgraph.Executor(b.build(), ExecutorConfig(max_parallel_ops=4)) as ex:
        assert await ex.execute(0) == 20
    # the first node is inline on the loop; from the first worker node on, one thread runs all
    assert seen[0] == threading.current_thread().name
    assert len(set(seen[1:])) == 1 and seen[1].startswith("asyncgraph-worker")


async def test_async_kernels_run_as_tasks_and_overlap() -> None:
    started = asyncio.Event()
    both = 0

    async def first(x: int) -> int:
        nonlocal both
        started.set()
        await asyncio.sleep(0.01)
        both += 1
        return x * 2

    async def second(x: int) -> int:
        await asyncio.wait_for(started.wait(), 5)  # only finishes if `first` started meanwhile
        return x * 3

    b = GraphBuilder()
    x = b.input("x")
    b.output((b.call(second, x), b.call(first, x)))
    async with asyncgraph.Executor(b.build()) as ex:
        assert await ex.execute(5) == (15, 10)


class _Blocker:
    """A kernel that blocks its worker thread until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.after_ran = 0

    def block(self, x: int) -> int:
        self.entered.set()
        assert self.release.wait(20)
        return x + 1

    def after(self, x: int) -> int:
        self.after_ran += 1
        return x * 10

    def graph(self) -> asyncgraph.Graph:
        b = GraphBuilder()
        y = b.call(self.block, b.input("x"), placement="worker")
        b.output(b.call(self.after, y, placement="worker"))
        return b.build()


async def test_cancel_waits_for_the_thread_and_drops_its_result() -> None:
    blocker = _Blocker()
    async with asyncgraph.Executor(blocker.graph(), ExecutorConfig(max_parallel_ops=1)) as ex:
        task = asyncio.create_task(ex.execute(1))
        assert await asyncio.to_thread(blocker.entered.wait, 20)
        task.cancel("client went away")
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting: a thread may write to the frame
        assert ex.statistics().frames.in_use == 1
        blocker.release.set()
        with pytest.raises(asyncio.CancelledError) as info:
            await task
        assert info.value.args == ("client went away",)
        assert blocker.after_ran == 0  # nothing was dispatched after the cancellation
        stats = ex.statistics()
        assert (stats.frames.in_use, stats.cancelled, stats.completed) == (0, 1, 0)
        blocker.entered.clear()
        assert await ex.execute(4) == 50  # the next execution is correct
        assert blocker.after_ran == 1


async def test_asyncio_timeout_becomes_timeout_error() -> None:
    blocker = _Blocker()
    async with asyncgraph.Executor(blocker.graph()) as ex:
        threading.Timer(0.2, blocker.release.set).start()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await ex.execute(1)
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0
        assert ex.statistics().frames.in_use == 0


async def test_anyio_fail_after_cancels() -> None:
    async def slow(x: int) -> int:
        await asyncio.sleep(10)
        return x

    b = GraphBuilder()
    b.output(b.call(slow, b.input("x")))
    async with asyncgraph.Executor(b.build()) as ex:
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.02):
                await ex.execute(1)
        assert ex.statistics().frames.in_use == 0


async def test_a_call_made_while_cancelled_takes_no_frame() -> None:
    b = GraphBuilder()
    b.output(b.call(lambda x: x + 1, b.input("x"), name="inc"))
    async with asyncgraph.Executor(b.build()) as ex:

        async def caller() -> int:
            current = asyncio.current_task()
            assert current is not None
            current.cancel()
            return int(await ex.execute(1))

        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(caller())
        assert ex.statistics().started == 0


def _stress_graph() -> asyncgraph.Graph:
    """Inline, worker and async nodes with random small latencies."""

    def heavy(x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.tanh(x @ x.T + k)

    async def remote(x: torch.Tensor, delay: float) -> torch.Tensor:
        await asyncio.sleep(delay)
        return x.sum(dim=0, keepdim=True)

    b = GraphBuilder()
    x = b.input("x")
    delay = b.input("delay")
    left = b.call(heavy, x, 1, name="left", placement="worker")
    right = b.call(heavy, x, 2, name="right", placement="worker")
    mid = b.call(torch.add, left, right, name="mid", placement="inline")
    far = b.call(remote, mid, delay, name="remote")
    b.output({"mid": mid, "far": far})
    return b.build()


def _reference(x: torch.Tensor) -> dict[str, torch.Tensor]:
    mid = torch.tanh(x @ x.T + 1) + torch.tanh(x @ x.T + 2)
    return {"mid": mid, "far": mid.sum(dim=0, keepdim=True)}


@pytest.mark.parametrize("seed", [0])
async def test_many_callers_with_cancellations_and_timeouts(seed: int) -> None:
    rng = random.Random(seed)
    inputs = [torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(50)]
    references = [_reference(x) for x in inputs]
    plan = [
        (i % 50, rng.random(), rng.uniform(0, 0.002), rng.uniform(0, 0.003))
        for i in range(2000)
    ]
    counts = {"completed": 0, "cancelled": 0, "timed_out": 0}
    config = ExecutorConfig(max_parallel_ops=2, max_concurrent_executions=8)
    async with asyncgraph.Executor(_stress_graph(), config) as ex:
        queue = list(reversed(plan))

        async def caller() -> None:
            while queue:
                index, roll, delay, limit = queue.pop()
                call = ex.execute(inputs[index], delay)
                if roll < 0.2:
                    task = asyncio.ensure_future(call)
                    await asyncio.sleep(limit)
                    task.cancel()
                    try:
                        out = await task
                    except asyncio.CancelledError:
                        counts["cancelled"] += 1
                        continue
                elif roll < 0.3:
                    try:
                        async with asyncio.timeout(limit):
                            out = await call
                    except TimeoutError:
                        counts["timed_out"] += 1
                        continue
                else:
                    out = await call
                torch.testing.assert_close(out, references[index])
                counts["completed"] += 1

        await asyncio.gather(*(caller() for _ in range(64)))
        stats = ex.statistics()
    assert sum(counts.values()) == 2000
    assert counts["cancelled"] > 0 and counts["timed_out"] > 0 and counts["completed"] > 1000
    assert stats.frames.high_water <= 8 and stats.frames.total <= 8
    assert stats.completed == counts["completed"]
    assert stats.started == stats.completed + stats.cancelled + stats.failed


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


async def test_weight_swap_under_load_never_mixes_versions() -> None:
    torch.manual_seed(0)
    versions = [TwoLayer() for _ in range(3)]
    ep = torch.export.export(versions[0], (torch.randn(2, 8),))
    x = torch.randn(2, 8)
    expected = [m(x).detach() for m in versions]
    states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in versions]
    config = ExecutorConfig(max_parallel_ops=2, heavy_op_flops=0, adaptive_placement=False)
    async with asyncgraph.Executor(ep, config) as ex:
        stop = False
        seen: set[int] = set()

        async def swapper() -> None:
            k = 0
            while not stop:
                k += 1
                ex.swap_weights(states[k % 3])
                await asyncio.sleep(0.002)

        async def caller() -> None:
            for _ in range(40):
                out = await ex.execute(x)
                matches = [i for i, e in enumerate(expected) if torch.allclose(out, e)]
                assert len(matches) == 1, "result matches no single weights version"
                seen.add(matches[0])

        swap_task = asyncio.create_task(swapper())
        await asyncio.gather(*(caller() for _ in range(32)))
        stop = True
        await swap_task
        assert ex.statistics().weights_version > 3
    assert len(seen) >= 2


async def test_swap_weights_checks_names_shapes_and_dtypes() -> None:
    model = TwoLayer()
    ep = torch.export.export(model, (torch.randn(2, 8),))
    async with asyncgraph.Executor(ep) as ex:
        with pytest.raises(asyncgraph.WeightsError, match="unknown weight name"):
            ex.swap_weights({"c.weight": torch.zeros(8, 8)})
        with pytest.raises(asyncgraph.WeightsError, match=r"a.weight.shape: expected \(8, 8\)"):
            ex.swap_weights({"a.weight": torch.zeros(4, 8)})
        dtype_error = r"a\.bias\.dtype: expected torch\.float32"
        with pytest.raises(asyncgraph.WeightsError, match=dtype_error):
            ex.swap_weights({"a.bias": torch.zeros(8, dtype=torch.float64)})
        with pytest.raises(asyncgraph.WeightsError, match="missing weight"):
            ex.swap_weights({"a.bias": torch.zeros(8)}, strict=True)
        x = torch.randn(2, 8)
        version = ex.swap_weights({"b.weight": torch.zeros(8, 8), "b.bias": torch.ones(8)})
        assert version == 1
        torch.testing.assert_close(await ex.execute(x), torch.ones(2, 8))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
async def test_workers_keep_the_intra_op_thread_count_of_the_process() -> None:
    """torch.set_num_threads does not reach new threads under OpenMP: a worker that did not
    set it again would run each matmul on every core (its own thread team, seen in /proc)."""
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(torch.mm, x, x, name="mm", placement="worker"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with asyncgraph.Executor(b.build(), ExecutorConfig(max_parallel_ops=1)) as ex:
            threads = len(os.listdir("/proc/self/task"))
            python_threads = set(threading.enumerate())
            a = torch.randn(512, 512)
            torch.testing.assert_close(await ex.execute(a), a @ a)
            started = len(os.listdir("/proc/self/task")) - threads
            new_python = set(threading.enumerate()) - python_threads
    finally:
        torch.set_num_threads(before)
    # Python threads: the worker, and the loop's default executor when the schedule was
    # compiled there; any thread beyond them would be a team of intra-op threads.
    assert any(t.name.startswith("asyncgraph-worker") for t in new_python)
    assert started == len(new_python)


def _recording(seen: list[str], name: str) -> Any:
    def node(*xs: int) -> int:
        seen.append(name)
        return sum(xs) + 1

    node.__name__ = name
    return node


async def test_the_longest_branch_starts_first() -> None:
    """Ready units are queued by the work ahead of them: the long branch, defined first
    (and so queued last by topological order), starts before the short ones."""
    seen: list[str] = []
    b = GraphBuilder()
    x = b.input("x")
    ends = []
    v = x
    for i in range(6):
        v = b.call(_recording(seen, f"long{i}"), v, placement="worker")
    ends.append(v)
    for i in range(3):
        ends.append(b.call(_recording(seen, f"short{i}"), x, placement="worker"))
    b.output(b.call(_recording(seen, "join"), *ends, placement="inline"))
    config = ExecutorConfig(max_parallel_ops=1, adaptive_placement=False)
    async with asyncgraph.Executor(b.build(), config) as ex:
        assert await ex.execute(0) == 10
    # one worker, depth-first along the long chain, then the short branches
    assert seen[:6] == [f"long{i}" for i in range(6)]
    assert sorted(seen[6:9]) == ["short0", "short1", "short2"] and seen[9] == "join"


async def test_measured_node_times_rank_the_branches() -> None:
    """After profiling, priorities come from measured times: one slow node outranks a
    branch of three fast ones, which its estimate (one node) does not."""
    seen: list[str] = []

    def slow(x: int) -> int:
        seen.append("slow")
        deadline = time.thread_time() + 0.003  # CPU time: what profiling measures
        while time.thread_time() < deadline:
            pass
        return x + 1

    b = GraphBuilder()
    x = b.input("x")
    v = x
    for i in range(3):
        v = b.call(_recording(seen, f"fast{i}"), v, placement="worker")
    s = b.call(slow, x, placement="worker")
    b.output(b.call(_recording(seen, "join"), v, s, placement="inline"))
    config = ExecutorConfig(max_parallel_ops=1, profile_executions=2)
    async with asyncgraph.Executor(b.build(), config) as ex:
        for _ in range(3):  # a warm-up and two profiled executions decide the placement
            await ex.execute(0)
        seen.clear()
        await ex.execute(0)
        stats = ex.placement_statistics()
        assert stats is not None and stats.decided == 1
    assert seen[0] == "slow", seen
