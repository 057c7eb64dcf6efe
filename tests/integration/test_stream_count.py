"""How many CUDA streams one execution gets (issue 50, item 5): a decision of the stream plan
(asyncgraph/cuda/streams.py's `choose_streams`), not a constant.

`CudaConfig.streams=None` (the default) is "auto": one stream, unless the plan has independent
branches whose estimated work is worth a stream of their own, then up to four. Uncaptured, a
second stream pays off only for kernels that keep the GPU busy longer than the host takes to
enqueue the next node (on an H200 the wide MLP ran 0.89x as fast on 4 streams as on 1);
inside a CUDA graph the host launches nothing, and 4 streams ran the same MLP 2.09x as fast,
so a captured plan counts smaller kernels as worth overlapping. An explicit count keeps its
meaning. On the simulated GPU (support/fake_gpu.py), through the Executor, and on the pure
planner.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from asyncgraph import Executor, GraphBuilder
from asyncgraph.cuda.streams import (
    AUTO_MAX_STREAMS,
    CAPTURED_OVERLAP_WORK,
    UNCAPTURED_OVERLAP_WORK,
    Role,
    choose_streams,
    plan_streams,
)
from asyncgraph.graph.ir import Graph, Node
from asyncgraph.kernels import OpKernel
from asyncgraph.runtime.config import CudaConfig
from tests.support.fake_gpu import CudaNodes, FakeBackend, Sim, ThreadGpu, gpu_config, gpu_running
from tests.support.gpu_graphs import add, add_one, chain, reference, wide

pytestmark = pytest.mark.usefixtures("leak_check")

C, A, H = Role.CUDA, Role.ALIAS, Role.HOST

HEAVY = UNCAPTURED_OVERLAP_WORK  # a kernel worth a stream of its own, captured or not
MEDIUM = CAPTURED_OVERLAP_WORK  # worth one only inside a CUDA graph


class CostedCudaNodes(CudaNodes):
    """CudaNodes whose `gpu_heavy*` nodes are estimated at `heavy` multiply-adds (HEAVY: an
    encoder's linear layer), the other `gpu*` nodes at CudaNodes' 1000."""

    def __init__(self, heavy: int = HEAVY) -> None:
        super().__init__()
        self.heavy = heavy

    def kernel_for(self, node: Node, graph: Graph) -> OpKernel | None:
        kernel = super().kernel_for(node, graph)
        if kernel is not None and node.name.startswith("gpu_heavy"):
            return OpKernel(kernel.fn, kernel.kind, kernel.name, cost=self.heavy,
                            device_type=kernel.device_type)
        return kernel


def heavy_branches(sim: Sim, width: int = 4, depth: int = 2) -> Graph:
    """`width` independent chains of heavy CUDA nodes from one input, summed by one node."""
    b = GraphBuilder()
    x = b.input("x")
    tails = []
    for k in range(width):
        v = x
        for d in range(depth):
            v = b.call(sim.kernel(add), v, k + d, name=f"gpu_heavy_b{k}_{d}")
        tails.append(v)
    b.output(b.call(sim.kernel(add), *tails, name="gpu_total"))
    return b.build()


def heavy_chain(sim: Sim, length: int = 6) -> Graph:
    """A chain of heavy CUDA nodes: nothing to overlap, however heavy."""
    b = GraphBuilder()
    v = b.input("x")
    for i in range(length):
        v = b.call(sim.kernel(add_one), v, name=f"gpu_heavy_{i}")
    b.output(v)
    return b.build()


@contextlib.asynccontextmanager
async def executor(graph: Graph, gpu: ThreadGpu, cuda: CudaConfig) -> AsyncIterator[Executor]:
    ex = Executor(graph, gpu_config(cuda), kernel_factory=CostedCudaNodes(),
                  _cuda_backend=FakeBackend(gpu))
    try:
        yield ex
    finally:
        async with gpu_running(gpu):
            await ex.aclose()


# -- through the Executor, on the simulated GPU ----------------------------------------------


def test_streams_default_to_auto() -> None:
    assert CudaConfig().streams is None
    assert CudaConfig(streams=None) == CudaConfig()
    with pytest.raises(ValueError, match=r"^streams must be >= 1 or None .*got 0$"):
        CudaConfig(streams=0)


@pytest.mark.parametrize("make", [chain, heavy_chain], ids=["light", "heavy"])
async def test_a_chain_gets_one_stream_by_default(make: object) -> None:
    gpu = ThreadGpu(0)
    sim = Sim(gpu)
    graph = make(sim)  # type: ignore[operator]
    async with gpu_running(gpu), executor(graph, gpu, CudaConfig()) as ex:
        sp = ex.stream_plan
        assert sp is not None
        assert sp.streams_per_device == 1, sp.stream_choice
        assert sp.streams_used == ((0, 0),)
        assert "auto" in sp.stream_choice
        out = await ex.execute(sim.upload(3))
        assert out.data == reference(graph, 3)[0]
    assert gpu.errors == []


async def test_light_independent_branches_get_one_stream_by_default() -> None:
    """The simulated `wide` graph: six branches of light kernels (1000 each), which 4 streams
    cannot overlap when the host launches them one by one: one stream, no events between
    CUDA nodes."""
    gpu = ThreadGpu(1)
    sim = Sim(gpu)
    graph = wide(sim)
    async with gpu_running(gpu), executor(graph, gpu, CudaConfig()) as ex:
        sp = ex.stream_plan
        assert sp is not None
        assert sp.streams_per_device == 1, sp.stream_choice
        assert len(sp.streams_used) == 1
        assert all(not sp.waits[i] for i in sp.cuda_nodes)
        total, read = await ex.execute(sim.upload(2))
        assert [total.data, read] == reference(graph, 2)
    assert gpu.errors == []


async def test_heavy_independent_branches_get_several_streams_by_default() -> None:
    gpu = ThreadGpu(2)
    sim = Sim(gpu)
    graph = heavy_branches(sim, width=4)
    async with gpu_running(gpu), executor(graph, gpu, CudaConfig()) as ex:
        sp = ex.stream_plan
        assert sp is not None
        assert sp.streams_per_device == AUTO_MAX_STREAMS == 4, sp.stream_choice
        assert len(sp.streams_used) == 4
        assert "auto: 4 streams" in sp.stream_choice
        for k in range(3):
            out = await ex.execute(sim.upload(k))
            assert out.data == reference(graph, k)[0]
    assert gpu.errors == [], sp.describe()


async def test_two_heavy_branches_get_two_streams() -> None:
    gpu = ThreadGpu(3)
    sim = Sim(gpu)
    graph = heavy_branches(sim, width=2)
    async with gpu_running(gpu), executor(graph, gpu, CudaConfig()) as ex:
        sp = ex.stream_plan
        assert sp is not None
        assert sp.streams_per_device == 2, sp.stream_choice
        assert len(sp.streams_used) == 2
    assert gpu.errors == []


@pytest.mark.parametrize("count", [1, 2, 4])
async def test_an_explicit_stream_count_is_honoured(count: int) -> None:
    gpu = ThreadGpu(4)
    sim = Sim(gpu)
    graph = wide(sim)  # light branches: auto would pick 1
    async with gpu_running(gpu), executor(graph, gpu, CudaConfig(streams=count)) as ex:
        sp = ex.stream_plan
        assert sp is not None
        assert sp.streams_per_device == count
        assert len(sp.streams_used) == count
        assert sp.stream_choice == f"CudaConfig.streams={count}"
        total, read = await ex.execute(sim.upload(5))
        assert [total.data, read] == reference(graph, 5)
    assert gpu.errors == [], sp.describe()


# -- the pure decision ---------------------------------------------------------------------------


def _fork(width: int, cost: float) -> tuple[list[list[int]], list[Role], list[float]]:
    """Node 0 a root, `width` branches of one node each reading it, node width+1 joining."""
    producers: list[list[int]] = [[]] + [[0] for _ in range(width)] + [list(range(1, width + 1))]
    roles = [C] * (width + 2)
    costs = [1.0] + [cost] * width + [1.0]
    return producers, roles, costs


@pytest.mark.parametrize(
    ("cost", "captured", "expected"),
    [
        (HEAVY, False, 4),
        (HEAVY, True, 4),
        (MEDIUM, False, 1),  # the wide MLP's linears uncaptured: 0.89x on 4 streams
        (MEDIUM, True, 4),  # the same inside a graph: 2.09x on 4 streams
        (MEDIUM - 1, True, 1),
        (1.0, True, 1),
    ],
)
def test_the_work_worth_a_stream_depends_on_capture(
    cost: float, captured: bool, expected: int
) -> None:
    producers, roles, costs = _fork(6, cost)
    count, why = choose_streams(producers, roles, costs=costs, captured=captured)
    assert count == expected, why
    assert why.startswith(f"auto: {expected} stream")
    assert ("(captured:" in why) == captured and ("(uncaptured:" in why) != captured


def test_light_roots_beside_a_heavy_chain_stay_on_one_stream() -> None:
    """A chain of heavy nodes and two light roots that a 4-stream plan spreads elsewhere
    (a constant made on the GPU, say): nothing heavy to overlap."""
    producers = [[], [], [0], [2, 1], [], [3, 4]]
    roles = [C] * 6
    costs = [HEAVY, 1.0, HEAVY, HEAVY, 1.0, HEAVY]
    wide_plan = plan_streams(producers, roles, 4, costs=costs)
    assert len(wide_plan.streams_used) > 1  # what a fixed 4 would have used
    count, why = choose_streams(producers, roles, costs=costs)
    assert count == 1, why


def test_auto_counts_per_device_and_takes_the_largest() -> None:
    producers, roles, costs = _fork(2, HEAVY)
    base = len(roles)
    more, more_roles, more_costs = _fork(3, HEAVY)
    producers += [[p + base for p in ps] for ps in more]
    roles += more_roles
    costs += more_costs
    devices = {i: (0 if i < base else 1) for i in range(len(roles))}
    count, why = choose_streams(producers, roles, costs=costs, devices=devices)
    assert count == 3, why


def test_without_cuda_nodes_or_costs_auto_is_one_stream() -> None:
    assert choose_streams([[], [0]], [H, A])[0] == 1
    producers, roles, _ = _fork(4, HEAVY)
    assert choose_streams(producers, roles)[0] == 1  # no costs: each node 1, light


@pytest.mark.parametrize(("graphs", "expected"), [(False, 1), (True, 4)])
async def test_the_executor_plans_streams_for_capture_when_graphs_are_on(
    graphs: bool, expected: int
) -> None:
    """cuda/backend.py passes `CudaConfig.graphs` to the stream plan: branches of medium
    work get streams of their own only where executions are captured."""
    gpu = ThreadGpu(5)
    sim = Sim(gpu)
    ex = Executor(heavy_branches(sim, width=4), gpu_config(CudaConfig(graphs=graphs)),
                  kernel_factory=CostedCudaNodes(MEDIUM),
                  _cuda_backend=FakeBackend(gpu))
    try:
        sp = ex.stream_plan
        assert sp is not None and sp.streams_per_device == expected, sp.stream_choice
    finally:
        async with gpu_running(gpu):
            await ex.aclose()
