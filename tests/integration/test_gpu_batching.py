"""Batches become CUDA graphs (issue 50, Do item 3): with whole-execution captures, concurrent
requests are batched by default (`BatchingConfig(only_captured=True)`) into vLLM's bucket
sizes, their rows copied straight into the bucket graph's static inputs (no torch.cat, no
thread hop, no kept bucket input between),
each bucket replaying its captured graph; size arithmetic of a dynamic-batch export
(`reshape(x, [b * 2, 4])`) is captured with the graph; batches are bounded in rows and bytes.

On the simulated GPU of support/cuda_graph_fake.py (whole executions captured: the programs'
tensors are declared on "cuda", the fake's are CPU tensors, so validation is off), and, where
a GPU is present, on it (`needs_gpu`: `make gpu-report` runs those). Each test ends with the
leak check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import operator
import warnings
from typing import Any

import anyio
import anyio.to_thread
import pytest
import sympy
import torch
from torch.export import Dim

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.cuda.capturable import signature_scalars
from asyncgraph.cuda.capture import MAX_CAPTURES
from asyncgraph.graph.importers import Program, from_exported_program
from asyncgraph.graph.ir import Graph, Node, TensorSpec
from asyncgraph.kernels import KernelFactory, KernelKind, OpKernel
from asyncgraph.runtime import batching
from asyncgraph.runtime.batching import (
    MAX_DEFAULT_BUCKETS,
    Batcher,
    BatchLayout,
    default_buckets,
)
from asyncgraph.runtime.bucket_inputs import BucketRows
from asyncgraph.runtime.config import CudaConfig
from tests.support.backends import run, settle
from tests.support.cuda_graph_fake import (
    CaptureBackend,
    CaptureGpu,
    diamond_graph,
    fake_kernel,
    make_executor,
    running,
    stats,
    with_parameters,
)
from tests.support.fake_gpu import gpu_config, gpu_running
from tests.support.real_gpu import needs_gpu

aten = torch.ops.aten
BATCH = Dim("batch", min=1, max=64)
W = torch.tensor([2.0, -1.0, 0.5, 3.0])


# -- programs --------------------------------------------------------------------------------


def _on_cuda(graph: Graph) -> Graph:
    """`graph` with every tensor spec on "cuda": whole executions are then capturable (the
    simulated GPU's tensors are CPU tensors; validation, which would refuse them, is off)."""
    values = [
        dataclasses.replace(v, spec=dataclasses.replace(v.spec, device=torch.device("cuda")))
        if isinstance(v.spec, TensorSpec) else v
        for v in graph.values
    ]
    return Graph(values, list(graph.nodes), graph.signature)


def diamond_rows() -> Program:
    """cuda_graph_fake's diamond (x * w, relu and sigmoid on two streams, joined) with x and
    the output [batch, 4]."""
    graph = diamond_graph()
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    rows = TensorSpec(torch.float32, torch.device("cuda"), (s0, 4), (4, 1))
    values = [dataclasses.replace(v, spec=rows) if v.name in ("x", "gpu_join") else v
              for v in graph.values]
    return with_parameters(Graph(values, list(graph.nodes), graph.signature), {"w": W})


def diamond_expected(x: torch.Tensor) -> torch.Tensor:
    scaled = x * W
    return torch.relu(scaled) + torch.sigmoid(scaled)


class Resize(torch.nn.Module):
    """Size arithmetic on the batch: rows reshaped by `b * 2`, then back by `b`; rows stay
    independent."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        y = self.lin(x).reshape(b * 2, 4)
        return (torch.relu(y) * 2).reshape(b, 8)


class ResizeByValue(torch.nn.Module):
    """The same size arithmetic, and a scalar read from GPU data (`.item()`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        return x.reshape(b * 2, 4).reshape(b, 8) * x.max().item()


def _export(model: torch.nn.Module, x: torch.Tensor) -> torch.export.ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), (x,), dynamic_shapes=({0: BATCH},))


class AllCuda(KernelFactory):
    """Every aten compute node a CUDA kernel of the simulated GPU (what an export on a GPU
    gets); size ops (sym_size, `mul` of sizes) stay host ops."""

    def __init__(self, gpu: CaptureGpu) -> None:
        super().__init__()
        self.gpu = gpu

    def kernel_for(self, node: Node, graph: Graph) -> OpKernel | None:
        kernel = super().kernel_for(node, graph)
        if kernel is not None and kernel.kind in (KernelKind.CPU, KernelKind.DEVICE):
            return OpKernel(fake_kernel(self.gpu, kernel.fn, node.name), KernelKind.DEVICE,
                            kernel.name, cost=1000, device_type="cuda")
        return kernel


def simulated_export(
    model: torch.nn.Module, gpu: CaptureGpu, **config: Any
) -> Executor:
    """An Executor of `model`'s dynamic-batch export, its tensors on the simulated GPU."""
    program = from_exported_program(_export(model, torch.randn(4, 8)))
    program = dataclasses.replace(program, graph=_on_cuda(program.graph), exported=None)
    return Executor(
        program,
        gpu_config(CudaConfig(graphs=True), validate_inputs=False, fast_paths=False, **config),
        kernel_factory=AllCuda(gpu), _cuda_backend=CaptureBackend(gpu),
    )


# -- counting ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Counts:
    cats: int = 0
    hops: int = 0
    into_bucket: int = 0  # bucket batches' rows copied into their kept bucket inputs
    into_static: int = 0  # ... copied straight into a graph's static inputs

    def zero(self) -> None:
        self.cats = self.hops = self.into_bucket = self.into_static = 0


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    """torch.cat calls, thread hops (`anyio.to_thread.run_sync`) and where bucket batches'
    rows are copied (`BucketRows.fill`) from now on; a test zeroes them where its count
    starts."""
    seen = Counts()
    cat, hop, fill = torch.cat, anyio.to_thread.run_sync, BucketRows.fill

    def counted_fill(self: BucketRows, into: Any) -> None:
        if into is self:
            seen.into_bucket += 1
        else:
            seen.into_static += 1
        fill(self, into)

    def counted_cat(*args: Any, **kwargs: Any) -> Any:
        seen.cats += 1
        return cat(*args, **kwargs)

    async def counted_hop(*args: Any, **kwargs: Any) -> Any:
        seen.hops += 1
        return await hop(*args, **kwargs)

    monkeypatch.setattr(torch, "cat", counted_cat)
    monkeypatch.setattr(anyio.to_thread, "run_sync", counted_hop)
    monkeypatch.setattr(BucketRows, "fill", counted_fill)
    return seen


def rows_of(n: int, seed: int) -> torch.Tensor:
    return torch.linspace(-2.0, 2.0, 4 * n).reshape(n, 4) * (seed % 5 + 1)


async def all_at_once(ex: Executor, xs: list[torch.Tensor]) -> list[Any]:
    """One caller per x, all at once (any backend); their outputs in order."""
    outs: list[Any] = [None] * len(xs)

    async def call(i: int) -> None:
        outs[i] = await ex.execute(xs[i])

    async with anyio.create_task_group() as group:
        for i in range(len(xs)):
            group.start_soon(call, i)
    return outs


async def callers(ex: Executor, sizes: list[int], seed: int = 0) -> None:
    """One caller per size, all at once; each gets exactly what the program gives its rows
    alone (the padding's rows dropped)."""
    xs = [rows_of(n, seed + i) for i, n in enumerate(sizes)]
    outs = await all_at_once(ex, xs)
    for x, out in zip(xs, outs, strict=True):
        assert out.shape == x.shape
        torch.testing.assert_close(out, diamond_expected(x))


# -- on by default where graphs are replayed ---------------------------------------------------


def test_default_buckets_fit_the_signatures_kept_captured() -> None:
    """Every default bucket of one batch key keeps its graph instances: the list is no longer
    than the signatures an Executor keeps captured."""
    assert MAX_DEFAULT_BUCKETS <= MAX_CAPTURES
    assert all(len(default_buckets(n)) <= MAX_CAPTURES for n in range(1, 1025))


def test_more_buckets_than_signatures_kept_captured_are_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Explicit buckets past what an Executor keeps captured would evict each other's graphs
    under load: said once, when the layout is made; not said without CUDA graphs."""
    program = diamond_rows().graph
    many = BatchingConfig(max_batch_size=16, buckets=tuple(range(1, 17)))
    with caplog.at_level("WARNING", logger="asyncgraph.batching"):
        batching.batch_layout(program, many, captured=False)
        assert caplog.records == []
        layout = batching.batch_layout(program, many, captured=True)
    assert layout.buckets == tuple(range(1, 17))
    (record,) = caplog.records
    assert "has 16 sizes, more than the 8 input signatures" in record.getMessage()


def test_only_captured_batches_a_captured_dynamic_batch_program(backend: str) -> None:
    """BatchingConfig(only_captured=True) batches where whole executions replay as graphs, into
    vLLM's buckets; a CUDA program without graphs runs requests alone, as does a CPU one."""
    policy = BatchingConfig(only_captured=True)

    async def body() -> None:
        gpu = CaptureGpu(seed=1)
        captured = make_executor(diamond_rows(), gpu, validate_inputs=False, batching=policy)
        uncaptured = make_executor(diamond_rows(), gpu, validate_inputs=False, batching=policy,
                                   graphs=False)
        cpu = Executor(_export(Resize(), torch.randn(4, 8)), ExecutorConfig(batching=policy))
        async with running(captured, gpu), running(uncaptured, gpu), cpu:
            for ex in (captured, uncaptured):
                await callers(ex, [1, 2, 3])
            x = torch.randn(3, 8)
            torch.testing.assert_close(await cpu.execute(x), Resize()(x))
            on = captured.batching_statistics()
            assert on is not None and on.requests == 3
            assert captured._batcher is not None  # white-box: the layout's buckets
            assert captured._batcher.layout.buckets == (1, 2, 4, 8, 16, 24, 32)
            assert uncaptured.batching_statistics() is None
            assert cpu.batching_statistics() is None
        assert gpu.errors == []

    run(body, backend)


def test_batching_is_on_by_default_only_where_whole_executions_replay(backend: str) -> None:
    """ExecutorConfig's default batching (CAPTURED_BATCHING) batches a captured dynamic-batch
    CUDA program into buckets; the same default on a CPU program, or with batching=None,
    runs every request alone; Executor.batching says which."""
    from asyncgraph.runtime.config import CAPTURED_BATCHING

    assert ExecutorConfig().batching is CAPTURED_BATCHING and CAPTURED_BATCHING.only_captured

    async def body() -> None:
        gpu = CaptureGpu(seed=2)
        default = make_executor(diamond_rows(), gpu, validate_inputs=False)
        off = make_executor(diamond_rows(), gpu, validate_inputs=False, batching=None)
        cpu = Executor(_export(Resize(), torch.randn(4, 8)))
        async with running(default, gpu), running(off, gpu), cpu:
            for ex in (default, off):
                await callers(ex, [1, 2, 3])
            assert default.batching is CAPTURED_BATCHING
            stats = default.batching_statistics()
            assert stats is not None and stats.requests == 3
            assert off.batching is None and off.batching_statistics() is None
            assert cpu.batching is None and cpu.batching_statistics() is None
        assert gpu.errors == []

    run(body, backend)


def test_a_plain_batching_config_still_refuses_a_program_without_a_batch_dim() -> None:
    """Only the only_captured form is silent: an explicit BatchingConfig on a program that
    cannot batch raises, naming why; None turns batching off."""
    from asyncgraph.errors import BatchingError

    async def body() -> None:
        gpu = CaptureGpu()
        program = diamond_rows()
        fixed = dataclasses.replace(program, graph=_fixed_batch(program.graph))
        with pytest.raises(BatchingError, match="dynamic batch dimension"):
            make_executor(fixed, gpu, validate_inputs=False, batching=BatchingConfig())
        quiet = make_executor(fixed, gpu, validate_inputs=False,
                              batching=BatchingConfig(only_captured=True))
        off = make_executor(program, gpu, validate_inputs=False, batching=None)
        async with running(quiet, gpu), running(off, gpu):
            assert quiet.batching_statistics() is None and off.batching_statistics() is None

    run(body, "asyncio")


def _fixed_batch(graph: Graph) -> Graph:
    rows = TensorSpec(torch.float32, torch.device("cuda"), (4, 4), (4, 1))
    values = [dataclasses.replace(v, spec=rows) if isinstance(v.spec, TensorSpec) else v
              for v in graph.values]
    return Graph(values, list(graph.nodes), graph.signature)


def test_only_captured_lowers_max_batch_size_to_the_exported_range(backend: str) -> None:
    """An export whose batch is at most 6 still batches by default: max_batch_size 32 is
    lowered to 6, and the buckets with it."""

    async def body() -> None:
        gpu = CaptureGpu(seed=2)
        program = diamond_rows()
        s0 = program.graph.signature.user_inputs[0]
        symbol = program.graph.values[s0.value].spec.shape[0]  # type: ignore[union-attr]
        signature = dataclasses.replace(
            program.graph.signature, range_constraints={symbol: (1, 6)})
        graph = Graph(list(program.graph.values), list(program.graph.nodes), signature)
        ex = make_executor(dataclasses.replace(program, graph=graph), gpu,
                           validate_inputs=False, batching=BatchingConfig(only_captured=True))
        async with running(ex, gpu):
            await callers(ex, [2, 3, 4])
            assert ex._batcher is not None  # white-box: the layout
            assert ex._batcher.layout.buckets == (1, 2, 4, 6)
            assert ex._batcher.config.max_batch_size == 6

    run(body, backend)


# -- 64 callers, bucket graphs ------------------------------------------------------------------


ROUNDS = [64, 20, 5, 3, 2, 1, 13, 7]


def test_64_callers_become_bucket_batches_that_replay_captured_graphs(
    backend: str, counts: Counts,
) -> None:
    """64 concurrent callers (and other loads) run as bucket-sized batches: at most one
    capture per bucket, then every batch replays its bucket's graph, its rows copied once,
    straight into the graph's static input (never into the kept bucket input first): no
    torch.cat, no thread hop, the padding's rows dropped."""

    async def body() -> None:
        gpu = CaptureGpu(seed=3, track_writers=True)
        ex = make_executor(diamond_rows(), gpu, graph_warmup=0, validate_inputs=False,
                           batching=BatchingConfig(only_captured=True, max_concurrent_batches=1))
        async with running(ex, gpu):
            for i, n in enumerate(ROUNDS):  # warm: each bucket captured once
                await callers(ex, [1] * n, seed=i)
            warm, warm_batches = stats(ex), ex.batching_statistics()
            batcher = ex._batcher
            assert batcher is not None
            made = batcher.bucket_inputs.made
            counts.zero()
            for i, n in enumerate(ROUNDS * 3):
                await callers(ex, [1] * n, seed=i)
            steady, batches = stats(ex), ex.batching_statistics()
        assert batches is not None and warm_batches is not None
        buckets = set(batcher.layout.buckets)
        assert warm.captures <= len(buckets) and warm.segment_captures == 0, warm
        assert steady.captures == warm.captures and steady.failures == 0, steady
        # every batch after warm-up replayed its bucket's graph: 9 batches per round of loads
        assert steady.replays - warm.replays == batches.batches - warm_batches.batches == 27
        assert steady.fallbacks == steady.warmups == 0, steady
        assert set(batches.by_size) <= buckets  # every batch ran at a bucket's size
        assert batches.padded_rows > 0 and batches.largest_batch == 32
        assert (counts.cats, counts.hops) == (0, 0)
        joined = sum(runs - warm_batches.by_size.get(size, (0,))[0]  # a lone request runs
                     for size, (runs, _) in batches.by_size.items() if size > 1)  # as it came
        assert joined > 0 and (counts.into_bucket, counts.into_static) == (0, joined), counts
        assert batcher.bucket_inputs.made == made  # the bucket inputs were reused
        assert gpu.errors == []

    run(body, backend)


# -- limits, cancellation ----------------------------------------------------------------------


async def _double(flat: list[Any]) -> list[Any]:
    await anyio.lowlevel.checkpoint()
    return [flat[0] * 2]


@pytest.mark.usefixtures("leak_check")
async def test_max_batch_bytes_bounds_a_batch_and_a_larger_request_runs_alone() -> None:
    """Requests of 48 bytes under a 100-byte limit go two by two, however many rows fit; a
    request of 160 bytes runs alone."""
    seen: list[int] = []

    async def run_batch(flat: list[Any]) -> list[Any]:
        seen.append(flat[0].shape[0])
        return await _double(flat)

    layout = BatchLayout((True,), sympy.Symbol("s0"), 32)
    batcher = Batcher(layout, BatchingConfig(max_batch_bytes=100), run_batch)
    xs = [torch.full((3, 4), float(i)) for i in range(5)] + [torch.ones(10, 4)]
    outs = await asyncio.gather(*(batcher.submit([x]) for x in xs))
    await batcher.aclose()
    assert sorted(seen) == [3, 6, 6, 10]
    for x, (out,) in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, x * 2)
    assert batcher.statistics().largest_batch == 10


def test_max_batch_bytes_is_checked() -> None:
    with pytest.raises(ValueError, match=r"^max_batch_bytes must be >= 1 or None"):
        BatchingConfig(max_batch_bytes=0)


@pytest.mark.usefixtures("leak_check")
async def test_gpu_tensors_are_never_stacked_on_a_thread(
    monkeypatch: pytest.MonkeyPatch, counts: Counts,
) -> None:
    """OFFLOAD_BYTES is a CPU heuristic: tensors elsewhere (meta here, as a GPU's would)
    are copied inline whatever their size, padded or not."""
    monkeypatch.setattr(batching, "OFFLOAD_BYTES", 0)
    for buckets in ((1, 2, 4, 8), ()):
        layout = BatchLayout((True,), sympy.Symbol("s0"), 8, buckets)
        batcher = Batcher(layout, BatchingConfig(max_batch_size=8), _double)
        xs = [torch.empty(r, 4, device="meta") for r in (1, 2)]
        outs = await asyncio.gather(*(batcher.submit([x]) for x in xs))
        await batcher.aclose()
        assert [out.shape[0] for (out,) in outs] == [1, 2]
    assert counts.hops == 0
    cpu = Batcher(BatchLayout((True,), sympy.Symbol("s0"), 8, (1, 2, 4, 8)),
                  BatchingConfig(max_batch_size=8), _double)
    await asyncio.gather(*(cpu.submit([torch.zeros(r, 4)]) for r in (1, 2)))
    await cpu.aclose()
    assert counts.hops == 1  # a CPU batch past OFFLOAD_BYTES still hops


@pytest.mark.usefixtures("leak_check")
async def test_an_output_that_is_its_input_keeps_the_bucket_input() -> None:
    """A bucket input returned as an output (or a view of one) is the callers' now: it is
    not reused, so the next batch cannot overwrite what they hold."""

    async def identity(flat: list[Any]) -> list[Any]:
        await anyio.lowlevel.checkpoint()
        return [flat[0][:]]

    layout = BatchLayout((True,), sympy.Symbol("s0"), 4, (1, 2, 4), captured=True)
    batcher = Batcher(layout, BatchingConfig(max_batch_size=4), identity)
    first = await asyncio.gather(*(batcher.submit([torch.full((1, 2), float(i))])
                                   for i in range(2)))
    second = await asyncio.gather(*(batcher.submit([torch.full((1, 2), 10.0 + i)])
                                    for i in range(2)))
    await batcher.aclose()
    assert [out[0, 0].item() for (out,) in first] == [0.0, 1.0]
    assert [out[0, 0].item() for (out,) in second] == [10.0, 11.0]
    assert batcher.bucket_inputs.made == 2


def test_a_request_cancelled_in_the_queue_leaves_its_bucket_batch(backend: str) -> None:
    """While one batch runs (the GPU paused), three callers queue; one is cancelled: the next
    batch holds the other two, padded to a bucket, and they get their own rows."""

    async def body() -> None:
        gpu = CaptureGpu(seed=4)
        ex = make_executor(diamond_rows(), gpu, graph_warmup=0, validate_inputs=False,
                           batching=BatchingConfig(only_captured=True, max_concurrent_batches=1))
        results: dict[int, torch.Tensor] = {}
        xs = {i: rows_of(1 + i % 2, seed=i) for i in range(4)}

        async def call(i: int) -> None:
            results[i] = await ex.execute(xs[i])

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(call, 0)
                await settle()  # batch 1 runs and waits for the paused GPU
                scope = anyio.CancelScope()

                async def cancelled_caller() -> None:
                    with scope:
                        await call(1)

                group.start_soon(cancelled_caller)
                group.start_soon(call, 2)
                group.start_soon(call, 3)
                await settle()
                scope.cancel()
                await settle()
                async with gpu_running(gpu):
                    pass
                while len(results) < 3:
                    async with gpu_running(gpu):
                        await settle(50)
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert sorted(results) == [0, 2, 3]
        for i in results:
            torch.testing.assert_close(results[i], diamond_expected(xs[i]))
        batches = ex.batching_statistics()
        assert batches is not None and batches.cancelled_in_queue == 1
        # caller 0 alone (1 row), then callers 2 and 3 (1 + 2 rows) padded to the bucket of 4
        assert set(batches.by_size) == {1, 4} and batches.padded_rows == 1, batches
        assert gpu.errors == []

    run(body, backend)


# -- size arithmetic of a dynamic-batch export --------------------------------------------------


def test_size_arithmetic_of_the_signature_is_captured_but_a_data_dependent_scalar_is_not() -> None:
    """`b * 2` of a sym_size depends on the input signature alone: part of the capture. A
    scalar read from GPU data (`.item()`) still blocks it, naming the node."""
    async def body() -> None:
        gpu = CaptureGpu()
        ex = simulated_export(Resize(), gpu)
        by_value = simulated_export(ResizeByValue(), gpu)
        async with running(ex, gpu), running(by_value, gpu):
            assert ex.cuda_graph_plan.capturable, ex.cuda_graph_plan.reason
            multiplies = [n.index for n in ex.graph.nodes if n.target is operator.mul]
            computed = signature_scalars(ex.graph, ex.stream_plan.roles)
            assert multiplies and set(multiplies) <= computed
            reason = by_value.cuda_graph_plan.reason
            assert not by_value.cuda_graph_plan.capturable
            assert reason is not None and reason.startswith("node 'item' (aten.item"), reason
            assert reason.endswith("reads a GPU value on the host"), reason

    run(body, "asyncio")


def test_a_dynamic_batch_export_with_size_arithmetic_captures_whole_per_bucket(
    backend: str,
) -> None:
    """torch.export with Dim("batch") of a model that reshapes by its batch size: batched by
    default into buckets, each bucket captured whole (no segments) and replayed, outputs as
    the model's."""
    model = Resize()

    async def body() -> None:
        gpu = CaptureGpu(seed=5)
        ex = simulated_export(model, gpu, graph_warmup=0,
                              batching=BatchingConfig(only_captured=True))
        g = torch.Generator().manual_seed(5)
        async with running(ex, gpu):
            for _ in range(3):  # new rows every round: a replay computes, it does not recall
                xs = [torch.randn(r, 8, generator=g) for r in (1, 2, 3) * 3]
                outs = await all_at_once(ex, xs)
                for x, out in zip(xs, outs, strict=True):
                    torch.testing.assert_close(out, _eager(model, x), rtol=1e-5, atol=1e-5)
            s, batches = stats(ex), ex.batching_statistics()
        assert s.capturable and s.segments == 0 and s.failures == 0, s
        assert batches is not None and set(batches.by_size) <= {1, 2, 4, 8, 16, 24, 32}
        assert 1 <= s.captures <= len(batches.by_size) and s.replays > s.captures, s
        assert gpu.errors == []

    run(body, backend)


class AndItsInput(torch.nn.Module):
    """A linear layer's output and the input itself: a replay hands the input back as it
    came, not a copy out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x


def test_a_program_that_returns_its_input_hands_each_caller_its_own_rows(
    backend: str, counts: Counts,
) -> None:
    """With an input among the outputs, a bucket batch's rows are copied into its bucket
    input before the replay (not only straight into the graph's static input), so each caller
    gets back its own rows, not the kept input's last contents."""
    model = AndItsInput()

    async def body() -> None:
        gpu = CaptureGpu(seed=6)
        ex = simulated_export(model, gpu, graph_warmup=0,
                              batching=BatchingConfig(only_captured=True))
        assert ex.cuda_graph_plan.inputs_out
        g = torch.Generator().manual_seed(6)
        async with running(ex, gpu):
            for _ in range(3):
                xs = [torch.randn(r, 8, generator=g) for r in (1, 2, 3) * 3]
                outs = await all_at_once(ex, xs)
                for x, (y, back) in zip(xs, outs, strict=True):
                    torch.testing.assert_close(back, x)
                    torch.testing.assert_close(y, _eager(model, x)[0], rtol=1e-5, atol=1e-5)
            s = stats(ex)
        assert s.replays > s.captures >= 1 and s.failures == 0, s
        assert counts.into_bucket > 0
        assert gpu.errors == []

    run(body, backend)


def _eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(x)
    return out


# -- on a real GPU (make gpu-report) -------------------------------------------------------------


def _gpu_config(**batching: Any) -> ExecutorConfig:
    return ExecutorConfig(cuda=CudaConfig(graphs=True, graph_warmup=1),
                          batching=BatchingConfig(only_captured=True, **batching))


@needs_gpu
def test_on_a_gpu_64_callers_replay_bucket_graphs_as_eager_computes(counts: Counts) -> None:
    """The dynamic-batch export with size arithmetic, on the GPU: captured whole, batched by
    default, 64 callers answered from bucket graphs with the eager model's outputs, no
    torch.cat and no thread hop once every bucket is captured."""
    model = Resize().cuda().eval()
    ep = _export(model, torch.randn(4, 8, device="cuda"))

    async def body() -> None:
        async with Executor(ep, _gpu_config()) as ex:
            assert ex.cuda_graph_plan.capturable, ex.cuda_graph_plan.reason
            for _ in range(3):  # warm-up, then each bucket's capture
                for i, n in enumerate(ROUNDS):
                    await _gpu_callers(ex, model, [1] * n, seed=i)
            warm = ex.cuda_graph_statistics()
            counts.cats = counts.hops = 0
            for i, n in enumerate(ROUNDS * 3):
                await _gpu_callers(ex, model, [1 + i % 3] * n, seed=i)
            s, batches = ex.cuda_graph_statistics(), ex.batching_statistics()
            buckets = ex._batcher.layout.buckets  # type: ignore[union-attr]
        assert warm is not None and s is not None and batches is not None
        assert s.segments == 0 and s.failures == 0, s
        assert s.captures <= 2 * len(buckets), s  # two batches in flight: two instances
        assert s.replays > warm.replays, s
        assert set(batches.by_size) <= set(buckets)
        assert counts.cats == 0 and counts.hops <= s.captures - warm.captures

    run(body, "asyncio")


@needs_gpu
def test_on_a_gpu_a_cancelled_queued_request_leaves_the_others_exact() -> None:
    """Callers cancelled while queued, on the GPU: the others still get their own rows."""
    model = Resize().cuda().eval()
    ep = _export(model, torch.randn(4, 8, device="cuda"))

    async def body() -> None:
        async with Executor(ep, _gpu_config(max_concurrent_batches=1)) as ex:
            xs = [torch.randn(1 + i % 3, 8, device="cuda") for i in range(48)]
            tasks = [asyncio.ensure_future(ex.execute(x)) for x in xs]
            await asyncio.sleep(0)
            for task in tasks[1::4]:
                task.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            for i, (x, out) in enumerate(zip(xs, done, strict=True)):
                if isinstance(out, BaseException):
                    assert i % 4 == 1 and isinstance(out, asyncio.CancelledError), out
                    continue
                torch.testing.assert_close(out, _eager(model, x), rtol=1e-4, atol=1e-4)

    run(body, "asyncio")


@needs_gpu
def test_on_a_gpu_batches_stay_within_max_batch_bytes() -> None:
    """A 128-byte limit (four rows of 8 floats): batches of at most four rows, whatever
    max_batch_size allows, each caller's rows exact."""
    model = Resize().cuda().eval()
    ep = _export(model, torch.randn(4, 8, device="cuda"))

    async def body() -> None:
        async with Executor(ep, _gpu_config(max_batch_bytes=4 * 8 * 4)) as ex:
            for seed in range(3):
                await _gpu_callers(ex, model, [1, 2, 1, 3, 1] * 4, seed=seed)
            batches = ex.batching_statistics()
        assert batches is not None and batches.largest_batch <= 4, batches
        assert batches.batches < batches.requests  # still batched

    run(body, "asyncio")


async def _gpu_callers(
    ex: Executor, model: torch.nn.Module, sizes: list[int], seed: int
) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(n, 8, device="cuda", generator=g) for n in sizes]
    outs = await all_at_once(ex, xs)
    for x, out in zip(xs, outs, strict=True):
        assert out.shape == x.shape
        torch.testing.assert_close(out, _eager(model, x), rtol=1e-4, atol=1e-4)
