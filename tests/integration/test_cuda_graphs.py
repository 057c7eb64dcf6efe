"""CUDA graphs (asyncgraph/cuda/graphs.py): what is captured, and captured executions.

1. `plan_capture` on builder graphs (pure): capturable programs, and the reason naming the
   first offending node, input or setting otherwise.
2. The Executor on the simulated GPU of support/cuda_graph_fake.py, which enforces what capture
   requires (no event query, synchronize or host read while capturing, forked and joined
   streams, replays writing the same static outputs), on asyncio and trio: warm-up, capture and
   replay counts, results equal to the uncaptured path, outputs that later replays do not
   overwrite, concurrent frames, weights swaps, failed captures, cancellation during a replay,
   eviction and close.
3. Real-GPU tests, skipped without CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sympy
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.cuda import capture as cuda_capture
from asyncgraph.cuda.capturable import CapturePlan
from asyncgraph.cuda.device import TorchCudaBackend
from asyncgraph.graph.importers import Program
from asyncgraph.graph.ir import Graph, OutputKind, OutputSpec, Signature, TensorSpec
from asyncgraph.runtime.config import CudaConfig
from asyncgraph.testing import LeakChecker, introspect
from tests.support.backends import run, settle, until
from tests.support.cuda_graph_fake import (
    CaptureBackend,
    CaptureEvent,
    CaptureGpu,
    CaptureStream,
    diamond_graph,
    diamond_program,
    fake_kernel,
    graph_instances,
    make_executor,
    running,
    stats,
    with_parameters,
)
from tests.support.fake_gpu import FakeStream, RecordingCuda, gpu_running
from tests.support.real_gpu import CUDA, MaskedFillSync, needs_gpu

aten = torch.ops.aten


# -- programs -------------------------------------------------------------------------------------


def expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    scaled = x * w
    return torch.relu(scaled) + torch.sigmoid(scaled)


def inputs(k: int, n: int = 4) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n) * (k + 1)


# =============================================================================================
# 1. What is captured (pure)
# =============================================================================================


def plan_of(graph: Graph | Program, **config: Any) -> CapturePlan | None:
    gpu = CaptureGpu()
    ex = make_executor(graph, gpu, **config)
    anyio.run(ex.aclose)  # built only to read its plan: nothing ran
    return ex.cuda_graph_plan


def test_a_program_of_cuda_aten_ops_is_capturable() -> None:
    plan = plan_of(diamond_program())
    assert plan is not None and plan.capturable and plan.reason is None
    assert plan.origin == (0, 0)
    # the scaled value is freed after its last reader, inside the capture; the output is not
    graph = diamond_graph()
    by_name = {v.name: v.id for v in graph.values}
    right = graph.node("gpu_right").index
    assert by_name["gpu_scale"] in plan.drops[right]
    assert plan.produced_outputs == (by_name["gpu_join"],)
    assert not any(by_name["gpu_join"] in d for d in plan.drops)
    assert "captured" in plan.describe()


def test_a_host_read_is_named_with_its_node_and_target() -> None:
    b = GraphBuilder()
    g = b.call(aten.relu.default, b.input("x"), name="gpu_relu")
    b.output(b.call(aten._local_scalar_dense.default, g, name="item_1"))
    plan = plan_of(b.build())
    assert plan is not None and not plan.capturable
    assert plan.reason == (
        "node 'item_1' (aten._local_scalar_dense.default) reads a GPU value on the host"
    )
    assert plan.describe() == f"not captured: {plan.reason}"


def python_kernel(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        (aten.nonzero.default, "node 'gpu_op' (aten.nonzero.default) syncs the host "
                               "(a data-dependent output shape)"),
        (aten.masked_select.default, "node 'gpu_op' (aten.masked_select.default) syncs"),
        (aten.relu_.default, "node 'gpu_op' (aten.relu_.default) mutates its arguments"),
        (python_kernel, "node 'gpu_op' (test_cuda_graphs.python_kernel) is a Python kernel"),
    ],
)
def test_uncapturable_cuda_nodes_are_named(target: Any, reason: str) -> None:
    b = GraphBuilder()
    x = b.input("x")
    first = b.call(aten.relu.default, x, name="gpu_first")
    args = (first, x) if target is aten.masked_select.default else (first,)
    b.output(b.call(target, *args, name="gpu_op"))
    plan = plan_of(b.build())
    assert plan is not None and not plan.capturable
    assert plan.reason is not None and plan.reason.startswith(reason)


def test_a_boolean_mask_index_is_not_captured_but_an_integer_index_is() -> None:
    def graph(dtype: torch.dtype) -> Graph:
        b = GraphBuilder()
        x, idx = b.input("x"), b.input("idx")
        b.output(b.call(aten.index.Tensor, x, [idx], name="gpu_index"))
        g = b.build()
        values = list(g.values)
        spec = TensorSpec(dtype, torch.device("cuda"), (4,), (4,))
        values[1] = dataclasses.replace(values[1], spec=spec)
        return Graph(values, list(g.nodes), g.signature)

    masked = plan_of(graph(torch.bool))
    assert masked is not None and masked.reason == (
        "node 'gpu_index' (aten.index.Tensor) indexes with a boolean mask "
        "(a data-dependent output shape)"
    )
    indexed = plan_of(graph(torch.int64))
    assert indexed is not None and indexed.capturable


def _with_specs(graph: Graph, specs: dict[str, TensorSpec]) -> Graph:
    """`graph` with the named values given tensor specs (GraphBuilder leaves them unknown)."""
    values = [
        dataclasses.replace(v, spec=specs[v.name]) if v.name in specs else v for v in graph.values
    ]
    return Graph(values, list(graph.nodes), graph.signature)


def _cuda(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cuda") -> TensorSpec:
    strides = tuple(int(torch.empty(shape).stride()[i]) for i in range(len(shape)))
    return TensorSpec(dtype, torch.device(device), shape, strides)


def test_only_the_one_argument_where_is_refused() -> None:
    """where(condition) is nonzero and syncs; where(condition, x, y) does not (masked
    attention's), so only that overload is refused (issue 36 item 3)."""
    def plan(target: Any, three: bool) -> CapturePlan | None:
        b = GraphBuilder()
        x, cond = b.input("x"), b.input("cond")
        args = (cond, x, b.call(aten.relu.default, x, name="gpu_y")) if three else (cond,)
        b.output(b.call(target, *args, name="gpu_where"))
        return plan_of(b.build())

    three = plan(aten.where.self, True)
    assert three is not None and three.capturable, three
    one = plan(aten.where.default, False)
    assert one is not None and one.reason == (
        "node 'gpu_where' (aten.where.default) syncs the host (a data-dependent output shape)"
    )


@pytest.mark.parametrize(("bounds", "capturable"), [((), False), ((10, 0.0, 0.0), False),
                                                     ((10, -1.0, 1.0), True)])
def test_histc_is_refused_when_it_reads_its_range_on_the_host(
    bounds: tuple[Any, ...], capturable: bool
) -> None:
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(aten.histc.default, b.call(aten.relu.default, x, name="gpu_r"), *bounds,
                    name="gpu_histc"))
    plan = plan_of(b.build())
    assert plan is not None and plan.capturable is capturable, plan
    if not capturable:
        assert plan.reason is not None and "histc with min == max" in plan.reason


def test_masked_fill_with_a_cuda_value_is_refused() -> None:
    b = GraphBuilder()
    x, mask, value = b.input("x"), b.input("mask"), b.input("value")
    b.output(b.call(aten.masked_fill.Tensor, x, mask, value, name="gpu_fill"))
    graph = _with_specs(b.build(), {"x": _cuda(4), "mask": _cuda(4, dtype=torch.bool),
                                    "value": _cuda()})
    plan = plan_of(graph)
    assert plan is not None and plan.reason is not None
    assert "masked_fill with a CUDA value reads it on the host" in plan.reason


def test_a_cuda_node_reading_a_cpu_tensor_is_not_captured_whole() -> None:
    """A CPU constant read by a CUDA node is a host-to-device copy inside the capture, and the
    graph would keep its value (issue 36 item 4): the whole-execution plan refuses it, naming
    the node and the tensor, as segments did."""
    b = GraphBuilder()
    x, table = b.input("x"), b.input("table")
    b.output(b.call(aten.add.Tensor, b.call(aten.relu.default, x, name="gpu_r"), table,
                    name="gpu_add"))
    graph = _with_specs(b.build(), {"x": _cuda(4), "table": _cuda(4, device="cpu")})
    program = with_parameters(graph, {"table": torch.ones(4)})
    plan = plan_of(program)
    assert plan is not None and plan.reason == (
        "node 'gpu_add' (aten.add.Tensor) reads cpu tensor 'table': a graph would keep the "
        "value it had when captured"
    )


@pytest.mark.timeout(60)
def test_an_input_returned_as_an_output_is_the_callers_tensor_after_a_capture() -> None:
    """Regression (issue 36 item 5): the capturing execution returned the static input buffer
    for an output that is an input, which every later replay overwrote."""
    b = GraphBuilder()
    x = b.input("x")
    b.output([x, b.call(aten.relu.default, x, name="gpu_relu")])

    async def body() -> None:
        gpu = CaptureGpu(seed=3)
        ex = make_executor(b.build(), gpu, graph_warmup=1)
        async with running(ex, gpu):
            held = []
            for k in range(4):
                x_k = inputs(k)
                out = await ex.execute(x_k)
                assert out[0] is x_k  # the caller's own tensor, as eager returns it
                held.append((x_k.clone(), out[0]))
            assert stats(ex).captures == 1 and stats(ex).replays == 2
            for expected_x, returned in held:
                torch.testing.assert_close(returned, expected_x)  # no replay changed them
        assert gpu.errors == []

    run(body, "asyncio")


def test_settings_and_mutated_inputs_are_reasons() -> None:
    assert (plan := plan_of(diamond_program(), graphs=False)) is not None
    assert plan.reason == "cuda.graphs=False"
    assert (plan := plan_of(diamond_program(), trace=True)) is not None
    assert plan.reason is not None and plan.reason.startswith("trace=True")
    g = diamond_graph()
    join = g.signature.outputs[0].arg
    mutation = OutputSpec(OutputKind.USER_INPUT_MUTATION, join, "x")  # the builder's input name
    mutating = Graph(list(g.values), list(g.nodes), Signature(
        g.signature.inputs, (*g.signature.outputs, mutation), None, g.signature.out_spec
    ))
    assert (plan := plan_of(mutating)) is not None
    assert plan.reason == "the program mutates input 'x': a replay writes its static copy"


async def test_a_cpu_program_has_no_capture_state(
    leak_check: LeakChecker,
) -> None:
    b = GraphBuilder()
    b.output(b.call(aten.relu.default, b.input("x"), name="relu"))
    async with Executor(b.build()) as ex:
        assert await ex.execute(torch.ones(2)) is not None
        assert ex.cuda_graph_plan is None and ex.cuda_graph_statistics() is None
        (frame,) = introspect.idle_frames(ex)
        assert frame.graphs is None


def test_cuda_graph_warmup_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="graph_warmup must be >= 0"):
        CudaConfig(graph_warmup=-1)


# =============================================================================================
# 2. Captured executions on the simulated GPU
# =============================================================================================


@pytest.mark.timeout(60)
def test_warm_up_then_capture_then_replays_equal_the_uncaptured_path(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=1)
        cuda = CaptureBackend(gpu)
        w = torch.tensor([2.0, -1.0, 0.5, 3.0])
        ex = make_executor(diamond_program(w), gpu, cuda, graph_warmup=2)
        plain = make_executor(diamond_program(w), gpu, graphs=False)
        async with running(ex, gpu), running(plain, gpu):
            seen = []
            for k in range(6):
                out = await ex.execute(inputs(k))
                torch.testing.assert_close(out, expected(inputs(k), w))
                torch.testing.assert_close(out, await plain.execute(inputs(k)))
                s = stats(ex)
                seen.append((s.warmups, s.captures, s.replays))
            assert seen == [(1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 1, 1), (2, 1, 2), (2, 1, 3)]
            (graph,) = cuda.graphs
            assert graph.replays == 4  # the capture's own replay, then one per execution
            (pool,) = cuda.pools
            assert len(pool.allocations) == 4  # the static output of each CUDA node
            assert gpu.captures == 1
            assert stats(plain).captures == 0 and stats(plain).reason == "cuda.graphs=False"
        assert gpu.errors == []
        assert all(g.freed for g in cuda.graphs)  # aclose freed the graphs

    run(body, backend)


@pytest.mark.timeout(60)
def test_an_input_that_requires_grad_leaves_the_static_buffers_out_of_autograd() -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=11)
        cuda = CaptureBackend(gpu)
        w = torch.full((4,), 2.0)
        ex = make_executor(diamond_program(w), gpu, cuda, graph_warmup=0)
        async with running(ex, gpu):
            for k in range(3):
                x = inputs(k).requires_grad_()
                torch.testing.assert_close(await ex.execute(x), expected(inputs(k), w))
            (instance,) = graph_instances(ex)
            assert instance.graph is not None
            (static,) = instance.static_inputs  # no autograd node per copy
            assert not static.requires_grad and static.grad_fn is None
        (graph,) = cuda.graphs
        assert stats(ex).replays == 2 and graph.replays == 3

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_each_input_signature_warms_up_and_captures_on_its_own(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=2)
        w = torch.tensor(1.5)
        ex = make_executor(diamond_program(w), gpu, graph_warmup=1)
        async with running(ex, gpu):
            for k in range(3):
                for n in (4, 8):
                    out = await ex.execute(inputs(k, n))
                    torch.testing.assert_close(out, expected(inputs(k, n), w))
            s = stats(ex)
            assert (s.warmups, s.captures, s.replays, s.live_graphs) == (2, 2, 2, 2)

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_size_read_by_a_meta_node_is_a_static_output_of_its_signature(backend: str) -> None:
    """A META node (sym_size) runs on the host during the capture; its int is the capture's
    value, right for every execution of the signature (the shape is part of it)."""

    async def body() -> None:
        gpu = CaptureGpu(seed=10)
        b = GraphBuilder()
        x = b.input("x")
        size = b.call(aten.sym_size.int, x, 0, name="size")
        b.output((b.call(aten.mul.Tensor, x, size, name="gpu_scale"), size))
        ex = make_executor(b.build(), gpu, graph_warmup=0)
        assert ex.stream_plan is not None and ex.stream_plan.roles[0].value == "meta"
        async with running(ex, gpu):
            for k in range(3):
                for n in (2, 5):
                    scaled, got = await ex.execute(inputs(k, n))
                    assert got == n
                    torch.testing.assert_close(scaled, inputs(k, n) * n)
            assert (stats(ex).captures, stats(ex).replays) == (2, 4)

    run(body, backend)


@pytest.mark.timeout(60)
def test_executions_profiled_by_adaptive_placement_count_as_warm_up() -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=2)
        w = torch.tensor(1.5)
        ex = make_executor(
            diamond_program(w), gpu, adaptive_placement=True, profile_executions=2,
            graph_warmup=3,
        )
        async with running(ex, gpu):
            for k in range(8):
                torch.testing.assert_close(await ex.execute(inputs(k)), expected(inputs(k), w))
            s = stats(ex)
            assert (s.warmups, s.captures, s.replays, s.fallbacks) == (3, 1, 4, 0)

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_a_held_output_is_not_overwritten_by_later_replays(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=3)
        w = torch.full((4,), 2.0)
        ex = make_executor(diamond_program(w), gpu, graph_warmup=0)
        async with running(ex, gpu):
            held = await ex.execute(inputs(0))  # the capture's result
            for k in range(1, 4):
                await ex.execute(inputs(k))  # replays of the same frame's graph
            torch.testing.assert_close(held, expected(inputs(0), w))
            assert stats(ex).replays == 3

    run(body, backend)


@pytest.mark.timeout(60)
def test_without_the_clone_a_later_replay_overwrites_a_held_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fake's replays write the same static outputs: handing them out uncloned is caught."""
    monkeypatch.setattr(cuda_capture, "clone", lambda value: value)

    async def body() -> None:
        gpu = CaptureGpu(seed=3)
        w = torch.full((4,), 2.0)
        ex = make_executor(diamond_program(w), gpu, graph_warmup=0)
        async with running(ex, gpu):
            held = await ex.execute(inputs(0))
            await ex.execute(inputs(1))
            assert torch.equal(held, expected(inputs(1), w))  # overwritten

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_a_gpu_program_with_nothing_to_move_is_not_profiled_before_its_capture() -> None:
    """Adaptive placement moves CPU nodes; an all-CUDA program has none, so profiling its
    executions node by node would only delay the capture (issue 36 item 9)."""
    async def body() -> None:
        gpu = CaptureGpu(seed=7)
        ex = make_executor(diamond_program(), gpu, graph_warmup=1, adaptive_placement=True)
        async with running(ex, gpu):
            for k in range(3):
                await ex.execute(inputs(k))
            assert ex.placement_statistics() is None
            s = stats(ex)
            assert (s.warmups, s.captures, s.replays) == (1, 1, 1)
        assert gpu.errors == []

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_each_graph_instance_has_a_pool_of_its_own() -> None:
    """Graph instances of different signatures may replay at once, so each has its own pool
    (before issue 50 a frame's captures, one per signature, shared the frame's pool). Memory
    stays what it was (issue 36 item 8): instances are bounded by the capture streams (32 /
    the plan's streams), as the frames that could capture were, so it is at most that many
    times the largest signature."""
    async def body() -> None:
        gpu = CaptureGpu(seed=6)
        cuda = CaptureBackend(gpu)
        w4, w8 = torch.full((4,), 0.5), torch.full((8,), 0.5)
        ex = make_executor(diamond_graph(), gpu, cuda, graph_warmup=0,
                           max_concurrent_executions=1)
        async with running(ex, gpu):
            for k in range(2):
                for n, w in ((4, w4), (8, w8)):
                    out = await ex.execute(inputs(k, n), w)
                    torch.testing.assert_close(out, expected(inputs(k, n), w))
            assert stats(ex).captures == 2 and stats(ex).replays == 2
            assert len(cuda.graphs) == 2 and len(cuda.pools) == 2
            pools = {id(instance.pool) for instance in graph_instances(ex)}
            assert pools == {id(p) for p in cuda.pools}
        assert gpu.errors == []

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_frames_never_share_a_capture_stream_past_the_pool(backend: str) -> None:
    """torch hands out capture streams round-robin from 32 per device, and graphs captured on
    one stream share its cuBLAS workspace: two replaying at once on it would race (issue 36
    item 7). Here the pool has 3 streams and 5 frames run at once: 3 graph instances are
    captured, each on a stream of its own, and the executions that find them busy wait for
    one (issue 50: before, the 2 frames without a lease ran on the stream path, trying again
    on every execution); every stream goes back when the Executor closes."""
    async def body() -> None:
        gpu = CaptureGpu(seed=5)
        cuda = CaptureBackend(gpu, capture_streams_per_device=3)
        w = torch.full((4,), 0.5)
        ex = make_executor(diamond_program(w), gpu, cuda, graph_warmup=1, streams=1,
                           max_concurrent_executions=5)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        results: dict[int, torch.Tensor] = {}

        async def call(k: int) -> None:
            results[k] = await ex.execute(inputs(k))

        try:
            for rnd in range(3):  # the GPU paused while all enqueue: five frames in use
                async with anyio.create_task_group() as group:
                    for k in range(5 * rnd, 5 * rnd + 5):
                        group.start_soon(call, k)
                    await until(lambda: ex.statistics().frames.in_use == 5, "five frames")
                    async with gpu_running(gpu):
                        await until(lambda: ex.statistics().frames.in_use == 0, "done")
            s = stats(ex)
            assert (s.captures, s.instances, s.fallbacks, s.lease_failures) == (3, 3, 0, 1), s
            assert s.warmups + s.captures + s.replays == 15 and s.instance_waits >= 1, s
            assert len(cuda.captured_on) == 3
            assert len(set(cuda.captured_on)) == 3  # no stream holds two frames' graphs
            assert cuda_capture.CAPTURE_STREAMS.held == held_before + 3
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert cuda_capture.CAPTURE_STREAMS.held == held_before  # given back on close
        for k, out in results.items():
            torch.testing.assert_close(out, expected(inputs(k), w))
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_concurrent_executions_on_different_frames_each_capture_their_own(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=4)
        cuda = CaptureBackend(gpu)
        w = torch.full((4,), 0.5)
        ex = make_executor(
            diamond_program(w), gpu, cuda, graph_warmup=1, max_concurrent_executions=2
        )
        results: dict[int, torch.Tensor] = {}

        async def call(k: int) -> None:
            results[k] = await ex.execute(inputs(k))

        try:
            for rnd in range(3):  # the GPU paused while both enqueue: two frames in use
                async with anyio.create_task_group() as group:
                    for k in (2 * rnd, 2 * rnd + 1):
                        group.start_soon(call, k)
                    await until(lambda: ex.statistics().frames.in_use == 2, "two frames")
                    async with gpu_running(gpu):
                        await until(lambda: ex.statistics().frames.in_use == 0, "done")
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        for k, out in results.items():
            torch.testing.assert_close(out, expected(inputs(k), w))
        s = stats(ex)
        # warm-up is the signature's (one execution), then the second execution of that
        # round captures an instance; next round one replays it while the other captures a
        # second instance (the first is busy), and the third round replays both
        assert (s.warmups, s.captures, s.replays) == (1, 2, 3)
        assert len(cuda.graphs) == len(cuda.pools) == 2  # a graph and a pool per instance
        assert {id(p.allocations[0]) for p in cuda.pools} != 1
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_swap_weights_recaptures_and_results_use_the_new_weights(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=5)
        cuda = CaptureBackend(gpu)
        old, new = torch.full((4,), 2.0), torch.tensor([-1.0, 0.0, 1.0, 4.0])
        ex = make_executor(diamond_program(old), gpu, cuda, graph_warmup=1)
        async with running(ex, gpu):
            for k in range(3):
                await ex.execute(inputs(k))
            assert stats(ex).captures == 1
            ex.swap_weights({"w": new})
            for k in range(3):  # at once: a capture for the new version, then replays
                torch.testing.assert_close(await ex.execute(inputs(k)), expected(inputs(k), new))
            s = stats(ex)
            assert (s.captures, s.recaptures, s.replays, s.live_graphs) == (2, 1, 3, 1)
            assert cuda.graphs[0].freed and not cuda.graphs[1].freed

    run(body, backend)


def syncing_graph() -> Graph:
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(aten.relu.default, x, name="gpu_relu")
    b.output(b.call(aten.clone.default, y, name="gpu_sync_check"))  # reads a GPU value inside
    return b.build()


@pytest.mark.timeout(60)
def test_a_capture_that_fails_falls_back_with_the_reason(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=6)
        cuda = CaptureBackend(gpu)
        ex = make_executor(syncing_graph(), gpu, cuda, graph_warmup=1)
        assert ex.cuda_graph_plan is not None and ex.cuda_graph_plan.capturable
        async with running(ex, gpu):
            for k in range(4):
                torch.testing.assert_close(await ex.execute(inputs(k)), torch.relu(inputs(k)))
            s = stats(ex)
            assert (s.warmups, s.captures, s.failures, s.fallbacks, s.replays) == (1, 0, 1, 2, 0)
            (reason,) = s.failed
            assert "operation not permitted when stream is capturing" in reason
            assert "gpu_sync_check" in reason and "aten.clone.default" in reason
            (graph,) = cuda.graphs  # one attempt only: the signature is now uncapturable
            assert graph.freed and not graph.captured
            assert gpu.capture is None  # the capture was closed
        assert gpu.errors == []

    with caplog.at_level(logging.WARNING, logger="asyncgraph.cuda.graphs"):
        run(body, backend)
    warnings = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.timeout(60)
def test_capture_streams_are_warmed_on_the_capturing_thread_before_the_capture() -> None:
    """Warm-up ran on the leased streams but capture records on the capture streams, so
    cuBLAS's per-(handle, stream) workspace was first allocated inside the capture, in the
    graph's pool (issue 36 item 6). The simulated GPU counts such first uses."""
    async def body() -> None:
        gpu = CaptureGpu(seed=9)
        cuda = CaptureBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=1)
        async with running(ex, gpu):
            for k in range(3):
                await ex.execute(inputs(k))
            assert stats(ex).captures == 1
            assert [p.workspaces for p in cuda.pools] == [0]
            # captured off the loop (issue 36 item 8): milliseconds no other request waits on
            assert cuda.capture_threads and threading.get_ident() not in cuda.capture_threads
        assert gpu.errors == []

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_a_capture_failing_on_a_forked_stream_joins_it_so_the_capture_can_end() -> None:
    """CUDA ends a capture only with every forked stream joined back. A capture whose node
    failed on a side stream left it unjoined, so the end failed as well, which on torch
    leaves the allocator in capture mode (issue 36 item 2): the failure path joins first."""
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    scaled = b.call(aten.mul.Tensor, x, w, name="gpu_scale")
    left = b.call(aten.relu.default, scaled, name="gpu_left")
    right = b.call(aten.sigmoid.default, scaled, name="gpu_sync_right")
    b.output(b.call(aten.add.Tensor, left, right, name="gpu_join"))
    program = with_parameters(b.build(), {"w": torch.full((4,), 2.0)})

    async def body() -> None:
        gpu = CaptureGpu(seed=8)
        cuda = CaptureBackend(gpu)
        ex = make_executor(program, gpu, cuda, graph_warmup=0, streams=4)
        assert ex.stream_plan is not None and len(ex.stream_plan.streams_used) == 2
        async with running(ex, gpu):
            for k in range(2):
                torch.testing.assert_close(await ex.execute(inputs(k)),
                                           expected(inputs(k), torch.full((4,), 2.0)))
            assert stats(ex).failures == 1
            assert cuda.failed_ends == 0  # joined, so the failed capture still ended
        assert gpu.errors == []

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_cancellation_during_a_replay_returns_the_frame_only_after_the_gpu(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=7)
        w = torch.full((4,), 2.0)
        ex = make_executor(diamond_program(w), gpu, graph_warmup=0,
                           max_concurrent_executions=1)
        cancelled: list[bool] = []
        second: list[torch.Tensor] = []
        try:
            async with gpu_running(gpu):
                await ex.execute(inputs(0))  # captured
            async with anyio.create_task_group() as group:
                scope = anyio.CancelScope()

                async def first() -> None:
                    with scope:
                        await ex.execute(inputs(1))
                    cancelled.append(scope.cancelled_caught)

                async def later() -> None:
                    second.append(await ex.execute(inputs(2)))

                group.start_soon(first)
                await until(lambda: ex.statistics().frames.in_use == 1, "replay enqueued")
                await settle()
                assert any(op[0] == "kernel" and op[1][0] == "replay"
                           for s in gpu.streams for op in s.queue)
                scope.cancel()
                await settle()
                assert not cancelled  # finish() absorbs it until the GPU is done
                group.start_soon(later)
                await settle()
                assert ex.statistics().frames.waiters == 1  # the frame is not handed on
                async with gpu_running(gpu):
                    await until(lambda: bool(second), "the second execution")
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert cancelled == [True]
        torch.testing.assert_close(second[0], expected(inputs(2), w))
        assert ex.statistics().cancelled == 1 and stats(ex).replays == 2
        assert ex.cuda_runtime is not None and ex.cuda_runtime.pool.in_use == 0
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_the_least_recently_used_signature_is_evicted_past_the_cap(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=8)
        cuda = CaptureBackend(gpu)
        ex = make_executor(diamond_program(torch.tensor(2.0)), gpu, cuda, graph_warmup=0,
                           max_captured_signatures=cuda_capture.MAX_CAPTURES)
        async with running(ex, gpu):
            for n in range(1, cuda_capture.MAX_CAPTURES + 2):
                await ex.execute(inputs(0, n))
            s = stats(ex)
            assert (s.captures, s.evictions, s.live_graphs) == (9, 1, 8)
            assert cuda.graphs[0].freed and not any(g.freed for g in cuda.graphs[1:])
            await ex.execute(inputs(0, 1))  # evicted: captured again (warm-up 0)
            assert stats(ex).captures == 10
        assert all(g.freed for g in cuda.graphs)

    run(body, backend)


# -- the fake's own rules -------------------------------------------------------------------------


def test_the_fake_refuses_what_cuda_refuses_while_capturing() -> None:
    gpu = CaptureGpu()
    cuda = CaptureBackend(gpu)
    origin, side = cuda.new_stream(0), cuda.new_stream(0)
    outside = cuda.new_event()
    outside.record(side)
    kernel = fake_kernel(gpu, torch.relu, "gpu_relu")
    x = torch.ones(2)

    def attempt(body: Callable[[CaptureEvent], None]) -> None:
        with cuda.capture(cuda.new_graph(), cuda.graph_pool(), origin):
            fork = cuda.new_event()
            fork.record(origin)
            body(fork)

    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        attempt(lambda fork: outside.query())
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        attempt(lambda fork: gpu.host_read("item"))

    def unforked(fork: CaptureEvent) -> None:
        token = cuda.enter_stream(side)
        try:
            kernel(x)
        finally:
            cuda.leave_stream(token)

    with pytest.raises(RuntimeError, match="did not join the capture"):
        attempt(unforked)

    def unjoined(fork: CaptureEvent) -> None:
        side.wait_event(fork)
        unforked(fork)

    with pytest.raises(RuntimeError, match="unjoined"):
        attempt(unjoined)
    with pytest.raises(RuntimeError, match="from outside the capture"):
        attempt(lambda fork: origin.wait_event(outside))
    assert gpu.capture is None and gpu.current is None


# -- the torch backend's capture, on a fake C layer ------------------------------------------------


class RecordingGraph:
    """torch.cuda.CUDAGraph's capture calls, logged with the stream current at each."""

    def __init__(self, cuda: RecordingCuda, fail_end: bool = False) -> None:
        self.cuda = cuda
        self.fail_end = fail_end

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.cuda.log.append(("capture_begin", pool, capture_error_mode, self.cuda.current[0]))

    def capture_end(self) -> None:
        self.cuda.log.append(("capture_end", self.cuda.current[0]))
        if self.fail_end:
            raise RuntimeError("capture invalidated")

    def reset(self) -> None:
        self.cuda.log.append(("reset", self.cuda.current[0]))


class StreamRecordingBackend(CaptureBackend):
    """Notes, at the end of each capture, the streams that had work recorded in it."""

    def __init__(self, gpu: CaptureGpu) -> None:
        super().__init__(gpu)
        self.recorded_on: list[set[str]] = []

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, handle: Any) -> Any:
        with super().capture(graph, pool, handle):
            yield
            capture = self.gpu.capture  # type: ignore[attr-defined]
            self.recorded_on.append({s.name for s in capture.last_work} | {handle.name})


@pytest.mark.timeout(60)
def test_a_capture_records_only_on_capture_streams_no_stream_set_uses(backend: str) -> None:
    """Capture records every launch on its streams, from any thread; the stream sets come
    from torch's default-priority pool (32 streams, round-robin), which 8 frames x 4 streams
    use up, so another frame could launch on a set stream while it is recorded into this
    frame's graph. Captures record on capture streams (`Backend.new_capture_stream`: the
    high-priority pool) instead. Before, the diamond was recorded on its leased set."""

    async def body() -> None:
        gpu = CaptureGpu(seed=3)
        cuda = StreamRecordingBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=0, streams=2)
        async with running(ex, gpu):
            for k in range(3):
                torch.testing.assert_close(
                    await ex.execute(inputs(k)), expected(inputs(k), torch.full((4,), 2.0))
                )
            assert stats(ex).captures == 1 and stats(ex).replays == 2
            runtime = ex.cuda_runtime
            assert runtime is not None
            set_streams = {
                s.name for stream_set in runtime.pool.sets for s in stream_set.streams.values()
            }
        (recorded,) = cuda.recorded_on
        assert len(recorded) == 2  # both streams of the plan, forked and joined
        assert all(name.startswith("cap") for name in recorded), recorded
        assert not recorded & set_streams
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_replay_orders_and_awaits_only_the_origin_stream(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay is one launch on the origin stream: the set's other streams get no begin
    wait and no end event (each would cost an event record, a wait and a poll). Before,
    `begin` and `finish` touched all of the set's streams on every replay."""
    touched: list[str] = []
    record, wait = CaptureEvent.record, CaptureStream.wait_event

    def logged_record(self: Any, stream: Any) -> None:
        touched.append(stream.name)
        record(self, stream)

    def logged_wait(self: Any, event: Any) -> None:
        touched.append(self.name)
        wait(self, event)

    async def body() -> None:
        gpu = CaptureGpu(seed=5)
        ex = make_executor(diamond_program(), gpu, graph_warmup=0, streams=2)
        async with running(ex, gpu):
            await ex.execute(inputs(0))  # the capture
            runtime = ex.cuda_runtime
            assert runtime is not None
            (stream_set,) = runtime.pool.sets
            assert len(stream_set.streams) == 2  # the diamond's two branches
            monkeypatch.setattr(CaptureEvent, "record", logged_record)
            monkeypatch.setattr(CaptureStream, "wait_event", logged_wait)
            for k in range(1, 3):
                out = await ex.execute(inputs(k))
                torch.testing.assert_close(out, expected(inputs(k), torch.full((4,), 2.0)))
            monkeypatch.undo()
            assert stats(ex).replays == 2
            origin = stream_set.streams[ex.cuda_graph_plan.origin]  # type: ignore[union-attr]
            set_names = {s.name for s in stream_set.streams.values()}
            assert {name for name in touched if name in set_names} == {origin.name}
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_capture_orders_the_origin_after_the_warm_up_on_the_capture_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warm-up before a capture runs real kernels on the capture streams, reading the
    static input buffers; the leased origin (which `finish` awaits, and on which the next
    replay copies new inputs into those buffers) waits for the capture origin."""
    waits: list[tuple[str, str]] = []
    wait_stream = FakeStream.wait_stream

    def logged(self: Any, other: Any) -> None:
        waits.append((self.name, other.name))
        wait_stream(self, other)

    monkeypatch.setattr(FakeStream, "wait_stream", logged)

    async def body() -> None:
        gpu = CaptureGpu(seed=6)
        cuda = CaptureBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=0, streams=2)
        async with running(ex, gpu):
            await ex.execute(inputs(0))
            runtime = ex.cuda_runtime
            assert runtime is not None
            (stream_set,) = runtime.pool.sets
            origin = stream_set.streams[ex.cuda_graph_plan.origin]  # type: ignore[union-attr]
        (captured_on,) = cuda.captured_on
        assert (origin.name, captured_on.name) in waits
        assert gpu.errors == []

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_replayed_outputs_are_inference_tensors_as_the_stream_paths_are(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=7)
        for inference_mode in (True, False):
            ex = make_executor(
                diamond_program(), gpu, graph_warmup=1, inference_mode=inference_mode
            )
            async with running(ex, gpu):
                seen = [(await ex.execute(inputs(k))).is_inference() for k in range(4)]
                assert stats(ex).replays == 2  # warm-up, capture, two replays
            assert seen == [inference_mode] * 4

    run(body, backend)


@pytest.mark.timeout(60)
def test_an_execution_finding_another_capture_recording_runs_uncaptured_then_captures() -> None:
    """One capture at a time per process (`CAPTURE_LOCK`): capture streams are drawn from a
    pool of 32, which two captures at once could share."""

    async def body() -> None:
        gpu = CaptureGpu(seed=4)
        cuda = CaptureBackend(gpu)
        w = torch.full((4,), 2.0)
        ex = make_executor(diamond_program(w), gpu, cuda, graph_warmup=0)
        async with running(ex, gpu):
            with cuda_capture.CAPTURE_LOCK:
                out = await ex.execute(inputs(0))
                torch.testing.assert_close(out, expected(inputs(0), w))
                assert (stats(ex).captures, stats(ex).fallbacks, stats(ex).failures) == (0, 1, 0)
            torch.testing.assert_close(await ex.execute(inputs(1)), expected(inputs(1), w))
            assert stats(ex).captures == 1
        assert gpu.errors == []

    run(body, "asyncio")


def test_torch_backend_draws_capture_streams_from_the_high_priority_pool() -> None:
    backend = TorchCudaBackend(RecordingCuda().functions())
    assert backend.new_capture_stream(1) == types.SimpleNamespace(device=1, priority=-1)
    assert backend.new_stream(1) == types.SimpleNamespace(device=1)


@pytest.mark.parametrize("fails", [False, True])
def test_torch_backend_captures_on_the_stream_thread_locally_without_synchronizing(
    fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """capture_begin/capture_end on the entered stream, thread-local mode, the stream restored;
    never torch.cuda.graph (whose __enter__ synchronizes the device) or synchronize. A body
    that raises still ends the capture, and its error (not capture_end's) propagates."""
    for name in ("synchronize", "graph", "empty_cache"):
        monkeypatch.setattr(
            torch.cuda, name, lambda *a, _n=name, **k: pytest.fail(f"torch.cuda.{_n} called")
        )
    cuda = RecordingCuda()
    backend = TorchCudaBackend(cuda.functions())
    graph = RecordingGraph(cuda, fail_end=fails)
    with contextlib.ExitStack() as stack:
        if fails:
            stack.enter_context(pytest.raises(ValueError, match="a sync inside"))
        with backend.capture(graph, "pool-1", (7, 0, 1)):  # type: ignore[arg-type]
            cuda.log.append(("body", cuda.current[0]))
            if fails:
                raise ValueError("a sync inside")
    captured = [c for c in cuda.log if c[0] in ("capture_begin", "body", "capture_end")]
    assert captured == [
        ("capture_begin", "pool-1", "thread_local", (7, 0, 1)),
        ("body", (7, 0, 1)),
        ("capture_end", (7, 0, 1)),
    ]
    assert cuda.current[0] == (0, 0, 1)  # the previous stream is current again


@pytest.mark.parametrize("body_fails", [False, True])
def test_torch_backend_gives_the_pool_back_when_the_capture_cannot_end(
    body_fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's capture_end checks cudaStreamEndCapture before it ends the allocator's
    allocation to the pool, and reset() releases only the pool of a capture that ended: one
    failed end left the allocator in capture mode for the process (issue 36 item 2). The
    backend ends it and releases the pool itself, then raises the capture's error."""
    released: list[tuple[str, int, Any]] = []
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name, lambda device, pool, _n=name:
                            released.append((_n, device, pool)), raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    cuda = RecordingCuda()
    backend = TorchCudaBackend(cuda.functions())
    monkeypatch.setattr(backend, "new_graph", lambda: RecordingGraph(cuda))
    graph = RecordingGraph(cuda, fail_end=True)
    expected = ValueError if body_fails else RuntimeError
    with pytest.raises(expected), backend.capture(graph, "pool-1", (7, 0, 1)):  # type: ignore[arg-type]
        if body_fails:
            raise ValueError("a sync inside")
    assert released == [("_cuda_endAllocateToPool", 3, "pool-1"),
                        ("_cuda_releasePool", 3, "pool-1")]
    # then one empty capture that ends, on the same stream, takes the CUDA generator out of
    # capture mode (a failed end left every later random op raising), and is reset
    captures = [c for c in cuda.log if c[0] in ("capture_begin", "capture_end", "reset")]
    assert captures[-4:] == [
        ("capture_end", (7, 0, 1)),
        ("capture_begin", None, "thread_local", (7, 0, 1)),
        ("capture_end", (7, 0, 1)),
        ("reset", (7, 0, 1)),
    ]
    assert cuda.current[0] == (0, 0, 1)


def test_the_capture_error_is_raised_when_the_generator_cannot_be_taken_out_of_capture(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = RecordingCuda()
    backend = TorchCudaBackend(cuda.functions())
    monkeypatch.setattr(backend, "new_graph", lambda: RecordingGraph(cuda, fail_end=True))
    failing = RecordingGraph(cuda, fail_end=True)
    with pytest.raises(ValueError, match="a sync"), backend.capture(failing, "p", (7, 0, 1)):  # type: ignore[arg-type]
        raise ValueError("a sync inside")
    assert "Offset increment outside graph capture" in caplog.text
    assert cuda.current[0] == (0, 0, 1)


# =============================================================================================
# 3. Real GPU
# =============================================================================================


class SmallModel(torch.nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.left = torch.nn.Linear(dim, dim)
        self.right = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.left(x)) + torch.sigmoid(self.right(x))


@needs_gpu
@pytest.mark.timeout(300)
async def test_gpu_captured_exported_model_matches_eager(
    leak_check: LeakChecker,
) -> None:
    torch.manual_seed(0)
    model = SmallModel().cuda().eval()
    ep = torch.export.export(model, (torch.randn(16, 64, device="cuda"),))
    config = ExecutorConfig(cuda=CudaConfig(graphs=True, graph_warmup=2), adaptive_placement=False)
    async with Executor(ep, config) as ex:
        assert ex.cuda_graph_plan is not None and ex.cuda_graph_plan.capturable, (
            ex.cuda_graph_plan
        )
        xs = [torch.randn(16, 64, device="cuda") for _ in range(6)]
        outs = [await ex.execute(x) for x in xs]
        with torch.no_grad():
            for out, x in zip(outs, xs, strict=True):
                torch.testing.assert_close(out, model(x))
        s = stats(ex)
        assert (s.warmups, s.captures, s.replays) == (2, 1, 3)


@needs_gpu
@pytest.mark.timeout(300)
async def test_gpu_a_held_output_survives_later_replays(
    leak_check: LeakChecker,
) -> None:
    torch.manual_seed(0)
    model = SmallModel().cuda().eval()
    ep = torch.export.export(model, (torch.randn(16, 64, device="cuda"),))
    config = ExecutorConfig(cuda=CudaConfig(graphs=True, graph_warmup=0), adaptive_placement=False)
    async with Executor(ep, config) as ex:
        x0 = torch.randn(16, 64, device="cuda")
        held = await ex.execute(x0)
        snapshot = held.clone()
        for _ in range(5):
            await ex.execute(torch.randn(16, 64, device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(held, snapshot)
        assert stats(ex).replays == 5


@needs_gpu
@pytest.mark.timeout(300)
async def test_gpu_after_a_capture_fails_random_ops_and_later_captures_work(
    leak_check: LeakChecker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed capture_end left torch's CUDA generator in capture mode: every later
    `torch.randn` on the GPU, dropout and capture of the process raised "Offset increment
    outside graph capture encountered unexpectedly" (H200, torch 2.11, 2026-11-27). The
    planner is made to accept masked_fill so that its capture fails."""
    from asyncgraph.cuda import capturable

    planner_blocker = capturable.node_blocker

    def accept_masked_fill(graph: Graph, index: int, *args: Any) -> str | None:
        if "masked_fill" in str(graph.nodes[index].target):
            return None
        return planner_blocker(graph, index, *args)

    monkeypatch.setattr(capturable, "node_blocker", accept_masked_fill)
    torch.manual_seed(0)
    model = MaskedFillSync().cuda().eval()
    ep = torch.export.export(model, (torch.randn(1024, device="cuda"),))
    config = ExecutorConfig(cuda=CudaConfig(graphs=True, graph_warmup=1), adaptive_placement=False)
    async with Executor(ep, config) as ex:
        for _ in range(3):
            x = torch.randn(1024, device="cuda")
            outs = await ex.execute(x)
            with torch.no_grad():
                torch.testing.assert_close(tuple(outs), model(x))
        assert stats(ex).failures == 1, stats(ex)
    monkeypatch.undo()

    noise = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5, training=True)
    assert 0 < int((noise == 0).sum()) < 4096
    small = SmallModel().cuda().eval()
    ep = torch.export.export(small, (torch.randn(16, 64, device="cuda"),))
    async with Executor(ep, config) as ex:
        for _ in range(3):
            x = torch.randn(16, 64, device="cuda")
            with torch.no_grad():
                torch.testing.assert_close(await ex.execute(x), small(x))
        assert (stats(ex).captures, stats(ex).failures) == (1, 0), stats(ex)


def test_real_gpu_tests_skip_without_cuda_with_a_reason() -> None:
    marker = needs_gpu.mark
    assert marker.name == "skipif" and marker.args[0] is (not CUDA)
    assert "CUDA" in marker.kwargs["reason"]



# -- asyncgraph profile -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_profile_says_whether_the_program_is_captured_and_why_not(backend: str) -> None:
    import io

    from rich.console import Console

    from asyncgraph.cli.profile import render
    from asyncgraph.tools.profile import collect

    def host_reading_graph() -> Graph:
        b = GraphBuilder()
        g = b.call(aten.relu.default, b.input("x"), name="gpu_relu")
        b.output(b.call(aten._local_scalar_dense.default, g, name="item_1"))
        return b.build()

    async def body() -> None:
        gpu = CaptureGpu(seed=9)
        lines = {}
        for name, program in (("diamond", diamond_program()), ("item", host_reading_graph())):
            ex = make_executor(program, gpu, trace=True)
            async with running(ex, gpu):
                metrics = await collect(ex, [inputs(0)], runs=2, warmup=1)
            assert stats(ex).captures == 0  # traced executions run node by node
            console = Console(file=io.StringIO(), width=200)
            render(metrics, console, top=3)
            lines[name] = metrics.cuda_graphs, console.file.getvalue()  # type: ignore[attr-defined]
        assert lines["diamond"][0] == (
            "captured as CUDA graphs (per input signature, after warm-up)"
        )
        assert "CUDA graphs: captured as CUDA graphs" in lines["diamond"][1]
        reason = "node 'item_1' (aten._local_scalar_dense.default) reads a GPU value on the host"
        assert lines["item"][0] == f"not captured: {reason}"
        assert f"CUDA graphs: not captured: {reason}" in lines["item"][1]

    run(body, backend)


@pytest.mark.timeout(90)
def test_batches_padded_to_buckets_capture_one_graph_per_bucket(backend: str) -> None:
    """With CUDA graphs, batching pads each batch to the next power of two (buckets=None):
    eight batch sizes are served by the captures of four buckets, not eight captures."""
    from asyncgraph import BatchingConfig

    batch = sympy.Symbol("s0", positive=True, integer=True)
    rows = TensorSpec(torch.float32, torch.device("cpu"), (batch, 4), (4, 1))  # the fake's
    graph = _with_specs(diamond_graph(), {"x": rows, "gpu_join": rows})
    program = with_parameters(graph, {"w": torch.full((4,), 2.0)})

    async def body() -> None:
        gpu = CaptureGpu(seed=8)
        ex = make_executor(
            program, gpu, graph_warmup=0, max_concurrent_executions=1,
            batching=BatchingConfig(max_batch_size=8),
        )
        async with running(ex, gpu):
            for n in (1, 2, 3, 4, 5, 6, 7, 8) * 2:
                x = inputs(n, 4 * n).reshape(n, 4)
                torch.testing.assert_close(await ex.execute(x), expected(x, torch.full((4,), 2.0)))
            batching = ex.batching_statistics()
            assert batching is not None and batching.padded_rows == 2 * (1 + 3 + 2 + 1)
            s = stats(ex)
            # the fake's tensors are on the CPU, so the diamond is captured as one segment
            assert (s.segment_captures, s.segment_replays, s.live_graphs) == (4, 12, 4), s
        assert gpu.errors == []

    run(body, backend)
