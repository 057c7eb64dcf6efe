"""CUDA-graph segments (asyncgraph/cuda/segments.py, `FrameSegments` in cuda/graphs.py).

A program with host nodes is not captured whole; its convex groups of capturable nodes are
captured one segment at a time, each one unit of the schedule.

1. `plan_segments` on builder graphs (pure): segments, splits of non-convex groups, groups too
   small to be worth a graph, the reason each node is left out.
2. The Executor on the simulated GPU of support/cuda_graph_fake.py (asyncio and trio): both runs
   around a host read captured and replayed, results equal to `cuda.graphs=False`, outputs read
   by host nodes and held by the caller, weights swaps, a failing capture, cancellation during
   a host wait between two replayed segments, close; `asyncgraph profile`'s listing.
3. A real-GPU test, skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from typing import Any

import anyio
import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.cuda import capture as cuda_capture
from asyncgraph.cuda.segments import SegmentPlan
from asyncgraph.graph.importers import Program
from asyncgraph.graph.ir import Graph, ScalarSpec
from asyncgraph.runtime.config import CudaConfig
from asyncgraph.testing import LeakChecker, introspect
from tests.support.backends import run, settle, until
from tests.support.cuda_graph_fake import (
    CaptureBackend,
    CaptureGpu,
    diamond_program,
    make_executor,
    running,
    stats,
    with_parameters,
)
from tests.support.fake_gpu import gpu_running
from tests.support.real_gpu import needs_gpu

aten = torch.ops.aten


def host_scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """A Python kernel: runs on the host (a worker), between the two segments."""
    return x * s


def two_runs_graph(sync_in_second: bool = False) -> Graph:
    """Two runs of CUDA nodes around a host read (`.item()` of a sum) and a host kernel."""
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    scaled = b.call(aten.mul.Tensor, x, w, name="gpu_scale")
    relu = b.call(aten.relu.default, scaled, name="gpu_relu")
    total = b.call(aten.sum.default, relu, name="gpu_sum")
    item = b.call(aten._local_scalar_dense.default, total, name="item_1")
    host = b.call(host_scale, relu, item, name="host_scale")
    mul = b.call(aten.mul.Tensor, host, w, name="gpu_mul")
    last = "gpu_sync_out" if sync_in_second else "gpu_out"
    b.output((b.call(aten.sigmoid.default, mul, name=last), item))
    return b.build()


def two_runs_program(w: torch.Tensor | None = None, sync_in_second: bool = False) -> Program:
    weight = torch.tensor([2.0, -1.0, 0.5, 3.0]) if w is None else w
    return with_parameters(two_runs_graph(sync_in_second), {"w": weight})


def expected(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, float]:
    relu = torch.relu(x * w)
    item = float(relu.sum())
    return torch.sigmoid(relu * item * w), item


def inputs(k: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 4) * (k + 1) / 4


def check(out: Any, x: torch.Tensor, w: torch.Tensor) -> None:
    want, item = expected(x, w)
    torch.testing.assert_close(out[0], want)
    assert out[1] == pytest.approx(item, rel=1e-5)


# =============================================================================================
# 1. The plan (pure)
# =============================================================================================


def segments_of(program: Graph | Program, **config: Any) -> SegmentPlan:
    gpu = CaptureGpu()
    ex = make_executor(program, gpu, **config)
    anyio.run(ex.aclose)  # built only to read its plan: nothing ran
    assert ex.cuda_segment_plan is not None
    return ex.cuda_segment_plan


def names(graph: Graph, nodes: Any) -> list[str]:
    return [graph.nodes[n].name for n in nodes]


def test_the_runs_around_a_host_read_are_two_segments_and_the_host_nodes_say_why() -> None:
    graph = two_runs_graph()
    plan = segments_of(two_runs_program())
    assert plan.reason is None
    assert [names(graph, s.nodes) for s in plan.segments] == [
        ["gpu_scale", "gpu_relu", "gpu_sum"], ["gpu_mul", "gpu_out"],
    ]
    first, second = plan.segments
    slot = {v.name: v.id for v in graph.values}
    assert first.outputs == (slot["gpu_relu"], slot["gpu_sum"])  # read by the host nodes
    assert set(first.inputs) == {slot["x"], slot["w"]} and first.weights == (slot["w"],)
    assert set(second.inputs) == {slot["host_scale"], slot["w"]}
    assert second.outputs == (slot["gpu_out"],)
    assert first.split is None
    assert second.split is not None and second.split.startswith(
        "node 'gpu_mul' reads 'host_scale', which depends on the group before"
    )
    assert [(graph.nodes[n].name, why) for n, why in plan.excluded] == [
        ("item_1", "reads a GPU value on the host"),
        ("host_scale", "runs on the host (role host)"),
    ]
    assert graph.node("gpu_sum").index in first.events  # the host read waits on it


def test_a_non_convex_group_is_split_and_an_independent_host_node_is_moved_out() -> None:
    """gpu_c reads h, which reads gpu_b: {a, b, c, d} would have h in the middle of a replay.
    In the second graph h reads only x: one segment, with h ordered before it."""

    def graph(h_reads_gpu: bool) -> Graph:
        b = GraphBuilder()
        x = b.input("x")
        a = b.call(aten.relu.default, x, name="gpu_a")
        bb = b.call(aten.mul.Tensor, a, a, name="gpu_b")
        h = b.call(host_scale, bb if h_reads_gpu else x, 2.0, name="host_h")
        c = b.call(aten.add.Tensor, h, bb, name="gpu_c")  # gpu_b is read: not dead code
        b.output(b.call(aten.relu.default, c, name="gpu_d"))
        return b.build()

    non_convex = graph(True)
    plan = segments_of(non_convex)
    assert [names(non_convex, s.nodes) for s in plan.segments] == [
        ["gpu_a", "gpu_b"], ["gpu_c", "gpu_d"],
    ]
    assert plan.segments[1].split == (
        "node 'gpu_c' reads 'host_h', which depends on the group before through a node that "
        "is not captured: one group would not be convex"
    )
    convex = graph(False)
    plan = segments_of(convex)
    assert [names(convex, s.nodes) for s in plan.segments] == [
        ["gpu_a", "gpu_b", "gpu_c", "gpu_d"],
    ]
    assert names(convex, plan.order) == ["host_h", "gpu_a", "gpu_b", "gpu_c", "gpu_d"]


def test_a_lone_cuda_node_a_host_scalar_and_a_denied_op_are_left_out_with_reasons() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(aten.relu.default, x, name="gpu_a")
    item = b.call(aten._local_scalar_dense.default, b.call(aten.sum.default, a, name="gpu_s"),
                  name="item_1")
    nz = b.call(aten.nonzero.default, a, name="gpu_nonzero")
    scaled = b.call(aten.mul.Tensor, a, item, name="gpu_by_item")
    lone = b.call(aten.sigmoid.default, nz, name="gpu_lone")
    b.output((scaled, lone))
    g = b.build()
    values = list(g.values)
    index = next(v.id for v in values if v.name == "item_1")
    values[index] = dataclasses.replace(values[index], spec=ScalarSpec(float, fixed=False))
    g = Graph(values, list(g.nodes), g.signature)
    plan = segments_of(g)
    assert [names(g, s.nodes) for s in plan.segments] == [["gpu_a", "gpu_s"]]
    reasons = {g.nodes[n].name: why for n, why in plan.excluded}
    assert reasons["gpu_nonzero"] == "syncs the host (a data-dependent output shape)"
    assert reasons["gpu_by_item"] == (
        "reads host value 'item_1' made by node 'item_1': a replay would keep the captured value"
    )
    assert reasons["gpu_lone"].startswith("is the only CUDA node of its capturable group")


def test_no_segments_for_a_wholly_captured_program_or_without_cuda_graphs() -> None:

    assert segments_of(diamond_program()).reason == "the whole execution is captured"
    assert segments_of(two_runs_program(), graphs=False).reason == "cuda.graphs=False"
    ex_plan = segments_of(two_runs_program(), trace=True)
    assert ex_plan.reason is not None and ex_plan.reason.startswith("trace=True")
    assert ex_plan.describe(two_runs_graph()) == [f"segments: none ({ex_plan.reason})"]


# =============================================================================================
# 2. Captured segments on the simulated GPU
# =============================================================================================


@pytest.mark.timeout(60)
def test_both_runs_around_a_host_read_are_captured_and_equal_the_uncaptured_path(
    backend: str,
) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=1)
        cuda = CaptureBackend(gpu)
        w = torch.tensor([2.0, -1.0, 0.5, 3.0])
        ex = make_executor(two_runs_program(w), gpu, cuda, graph_warmup=2, streams=4)
        plain = make_executor(two_runs_program(w), gpu, graphs=False, streams=4)
        async with running(ex, gpu), running(plain, gpu):
            seen = []
            for k in range(5):
                out = await ex.execute(inputs(k))
                check(out, inputs(k), w)
                same = await plain.execute(inputs(k))
                torch.testing.assert_close(out[0], same[0])
                assert out[1] == same[1]
                s = stats(ex)
                seen.append((s.segment_warmups, s.segment_captures, s.segment_replays))
            # per segment: two warm-ups, a capture, then replays
            assert seen == [(2, 0, 0), (4, 0, 0), (4, 2, 0), (4, 2, 2), (4, 2, 4)]
            assert (stats(ex).segments, stats(ex).live_graphs, stats(ex).captures) == (2, 2, 0)
            assert [g.replays for g in cuda.graphs] == [3, 3]  # the capture's own, then 2 each
            # the capture streams were warmed on the capturing thread first (issue 36 item 6)
            assert [p.workspaces for p in cuda.pools] == [0, 0]
            assert stats(plain).segments == 0 and stats(plain).segment_captures == 0
            (frame,) = introspect.idle_frames(ex)
            assert frame.schedule is not None and frame.schedule.segments.count(-1) == 2
            # the second segment's input, made by the host kernel, is marked used on its origin
            # stream by each replay: the frame drops it when the unit ends
            assert ex.cuda_segment_plan is not None
            second = ex.cuda_segment_plan.segments[1]
            assert second.made_inputs == (ex.graph.node("host_scale").output,)
            assert ex.cuda_runtime is not None
            (stream_set,) = ex.cuda_runtime.pool.sets
            origin = stream_set.streams[second.origin]
            on_origin = [v for v, s in cuda.recorded if s is origin]
            # three launches of each segment (a capture's own replay, then two): the first
            # segment's two clones are marked on its side stream (this one), the second's
            # host-made input on this, its origin
            assert len(on_origin) == 3 * 2 + 3 * 1
        assert gpu.errors == []
        assert all(g.freed for g in cuda.graphs)  # aclose freed the graphs

    run(body, backend)


@pytest.mark.timeout(60)
def test_held_outputs_and_outputs_read_by_host_nodes_survive_later_replays(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=3)
        w = torch.full((4,), 2.0)
        ex = make_executor(two_runs_program(w), gpu, graph_warmup=0)
        async with running(ex, gpu):
            held = await ex.execute(inputs(0))  # the captures' own results
            for k in range(1, 4):
                check(await ex.execute(inputs(k)), inputs(k), w)  # host reads after replays
            check(held, inputs(0), w)
            assert stats(ex).segment_replays == 6

    run(body, backend)


@pytest.mark.timeout(60)
def test_without_the_clone_a_later_replay_overwrites_a_held_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda_capture, "clone", lambda value: value)

    async def body() -> None:
        gpu = CaptureGpu(seed=3)
        w = torch.full((4,), 2.0)
        ex = make_executor(two_runs_program(w), gpu, graph_warmup=0)
        async with running(ex, gpu):
            held = await ex.execute(inputs(0))
            later = await ex.execute(inputs(1))
            assert torch.equal(held[0], later[0])  # the same static tensor, overwritten
            assert not torch.allclose(held[0], expected(inputs(0), w)[0])

    run(body, "asyncio")


@pytest.mark.timeout(60)
def test_swap_weights_recaptures_every_segment(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=5)
        cuda = CaptureBackend(gpu)
        old, new = torch.full((4,), 2.0), torch.tensor([-1.0, 0.0, 1.0, 4.0])
        ex = make_executor(two_runs_program(old), gpu, cuda, graph_warmup=1)
        async with running(ex, gpu):
            for k in range(3):
                check(await ex.execute(inputs(k)), inputs(k), old)
            assert stats(ex).segment_captures == 2
            ex.swap_weights({"w": new})
            for k in range(3):
                check(await ex.execute(inputs(k)), inputs(k), new)
            s = stats(ex)
            assert (s.segment_captures, s.recaptures, s.live_graphs) == (4, 2, 2)
            assert [g.freed for g in cuda.graphs] == [True, True, False, False]

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_segment_whose_capture_fails_runs_uncaptured_and_the_other_is_replayed(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=6)
        w = torch.full((4,), 2.0)
        ex = make_executor(two_runs_program(w, sync_in_second=True), gpu, graph_warmup=1)
        async with running(ex, gpu):
            for k in range(4):
                check(await ex.execute(inputs(k)), inputs(k), w)
            s = stats(ex)
            assert (s.segment_captures, s.failures, s.segment_fallbacks) == (1, 1, 2)
            assert s.segment_replays == 2  # the first segment
            (reason,) = s.failed
            assert "operation not permitted when stream is capturing" in reason
            assert "gpu_sync_out" in reason
            assert gpu.capture is None
        assert gpu.errors == []

    with caplog.at_level(logging.WARNING, logger="asyncgraph.cuda.graphs"):
        run(body, backend)
    assert len([r for r in caplog.records if "capture of segment 1 failed" in r.getMessage()]) == 1


@pytest.mark.timeout(60)
def test_cancellation_during_the_host_wait_between_two_replayed_segments(backend: str) -> None:
    """The first segment's replay is enqueued, the GPU paused: the host read waits for it.
    Cancelled there, the execution returns its frame only once the GPU is done."""

    async def body() -> None:
        gpu = CaptureGpu(seed=7)
        w = torch.full((4,), 2.0)
        ex = make_executor(two_runs_program(w), gpu, graph_warmup=0,
                           max_concurrent_executions=1)
        cancelled: list[bool] = []
        second: list[Any] = []
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
                try:
                    await until(lambda: stats(ex).segment_replays == 1, "first replayed")
                    await settle()
                    assert stats(ex).segment_replays == 1  # the host read waits on the GPU
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
                except BaseException:  # a failure: let the paused executions end, then raise
                    scope.cancel()
                    with anyio.CancelScope(shield=True):
                        async with gpu_running(gpu):
                            await until(lambda: ex.statistics().frames.in_use == 0, "idle")
                    raise
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert cancelled == [True]
        check(second[0], inputs(2), w)
        assert ex.statistics().cancelled == 1
        assert stats(ex).segment_replays == 3  # the cancelled execution's second never ran
        assert ex.cuda_runtime is not None and ex.cuda_runtime.pool.in_use == 0
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("warmup", [0, 3])
def test_an_error_in_a_segment_node_fails_the_execution_naming_the_node(
    backend: str, warmup: int
) -> None:
    """On the stream path (warm-up) and in a capture (where it also marks the signature
    uncapturable), the kernel's error is the execution's, naming its node (not the first of
    the segment's unit)."""

    async def body() -> None:
        gpu = CaptureGpu(seed=13)
        b = GraphBuilder()
        x, y = b.input("x"), b.input("y")
        a = b.call(aten.relu.default, x, name="gpu_a")
        total = b.call(aten.sum.default, a, name="gpu_sum")
        product = b.call(aten.mul.Tensor, a, y, name="gpu_mul")
        b.output((product, b.call(aten._local_scalar_dense.default, total, name="item_1")))
        g = b.build()
        ex = make_executor(g, gpu, graph_warmup=warmup)
        assert ex.cuda_segment_plan is not None
        (segment,) = ex.cuda_segment_plan.segments
        assert names(g, segment.nodes) == ["gpu_a", "gpu_sum", "gpu_mul"]
        async with running(ex, gpu):
            with pytest.raises(RuntimeError, match="must match the size") as caught:
                await ex.execute(torch.ones(4), torch.ones(3))
            notes = caught.value.__notes__
            assert any("%gpu_mul" in note for note in notes), notes
            assert not any("%gpu_a " in note for note in notes), notes
            out, total_ = await ex.execute(torch.ones(4), torch.full((4,), 2.0))
            torch.testing.assert_close(out, torch.full((4,), 2.0))
            assert total_ == 4.0
        assert ex.statistics().failed == 1
        assert gpu.errors == []

    run(body, backend)


def fork_then_nonzero_graph() -> Graph:
    """A segment over two streams (gpu_b on the origin, gpu_c on a side stream) and, outside
    it, nonzero (not capturable) continuing gpu_c's side stream: ordered after gpu_c only by
    stream order, so after a replay the side stream must wait for the replay."""
    b = GraphBuilder()
    a = b.call(aten.relu.default, b.input("x"), name="gpu_a")
    left = b.call(aten.sigmoid.default, a, name="gpu_b")
    right = b.call(aten.neg.default, a, name="gpu_c")
    b.output((left, b.call(aten.nonzero.default, right, name="gpu_nonzero")))
    return b.build()


@pytest.mark.timeout(60)
def test_a_cuda_node_after_a_segment_on_a_side_stream_runs_after_the_replay(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake checks GPU order here (`track_writers`): gpu_nonzero needs the replay (whose
    clone of gpu_c it reads) to have run first, on whatever stream interleaving."""
    clone = cuda_capture.clone

    async def body() -> None:
        gpu = CaptureGpu(seed=12, track_writers=True)

        def tracked_clone(value: Any) -> Any:  # the clone is a kernel after the replay
            out = clone(value)
            gpu.adopt(out, value)
            return out

        monkeypatch.setattr(cuda_capture, "clone", tracked_clone)
        graph = fork_then_nonzero_graph()
        ex = make_executor(graph, gpu, graph_warmup=0, streams=4)
        assert ex.stream_plan is not None and ex.cuda_segment_plan is not None
        (segment,) = ex.cuda_segment_plan.segments
        assert names(graph, segment.nodes) == ["gpu_a", "gpu_b", "gpu_c"]
        assert segment.streams == ((0, 0), (0, 1))
        nonzero = graph.node("gpu_nonzero").index
        assert ex.stream_plan.key(nonzero) == (0, 1) and not ex.stream_plan.waits[nonzero]
        async with running(ex, gpu):
            for k in range(12):
                x = inputs(k) - 0.1
                left, nz = await ex.execute(x)
                torch.testing.assert_close(left, torch.sigmoid(torch.relu(x)))
                torch.testing.assert_close(nz, torch.nonzero(-torch.relu(x)))
            assert stats(ex).segment_replays == 11
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_profile_lists_the_segments_and_the_nodes_left_out(backend: str) -> None:
    from rich.console import Console

    from asyncgraph.cli.profile import render
    from asyncgraph.tools.profile import collect

    async def body() -> None:
        gpu = CaptureGpu(seed=9)
        ex = make_executor(two_runs_program(), gpu, trace=True)
        async with running(ex, gpu):
            metrics = await collect(ex, [inputs(0)], runs=2, warmup=1)
        assert stats(ex).segment_captures == 0  # traced executions run node by node
        assert metrics.cuda_graph_segments[:2] == (
            "segment 0: 3 nodes on 1 stream(s): gpu_scale, gpu_relu, gpu_sum",
            "segment 1: 2 nodes on 1 stream(s): gpu_mul, gpu_out (split: node 'gpu_mul' reads "
            "'host_scale', which depends on the group before through a node that is not "
            "captured: one group would not be convex)",
        )
        assert metrics.cuda_graph_segments[2:] == (
            "not captured: node 'item_1' (aten._local_scalar_dense.default) reads a GPU value "
            "on the host",
            "not captured: node 'host_scale' (test_cuda_graph_segments.host_scale) runs on the "
            "host (role host)",
        )
        console = Console(file=io.StringIO(), width=300)
        render(metrics, console, top=3)
        text = console.file.getvalue()  # type: ignore[attr-defined]
        assert "  segment 1: 2 nodes" in text and "  not captured: node 'item_1'" in text

    run(body, backend)


# =============================================================================================
# 3. Real GPU
# =============================================================================================


class ItemModel(torch.nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.first = torch.nn.Linear(dim, dim)
        self.second = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        scale = h.abs().max().item()  # a host read between two runs
        return torch.sigmoid(self.second(h / (scale + 1.0)))


@needs_gpu
@pytest.mark.timeout(300)
async def test_gpu_segments_of_an_exported_model_match_eager(leak_check: LeakChecker) -> None:
    torch.manual_seed(0)
    model = ItemModel().cuda().eval()
    ep = torch.export.export(model, (torch.randn(16, 64, device="cuda"),))
    config = ExecutorConfig(cuda=CudaConfig(graphs=True, graph_warmup=1), adaptive_placement=False)
    async with Executor(ep, config) as ex:
        assert ex.cuda_segment_plan is not None and ex.cuda_segment_plan.segments
        xs = [torch.randn(16, 64, device="cuda") for _ in range(5)]
        outs = [await ex.execute(x) for x in xs]
        with torch.no_grad():
            for out, x in zip(outs, xs, strict=True):
                torch.testing.assert_close(out, model(x))
        assert stats(ex).segment_replays > 0
