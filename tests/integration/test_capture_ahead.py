"""Capture ahead, off the serving path (asyncgraph/cuda/graphs.py's CaptureAhead, issue 50
item 2): `Executor.warm_up(example)` and `CudaConfig(capture_ahead=True)`.

A signature's graph instances are captured before executions need them, on a thread, never
on the loop; executions meanwhile run on the stream path (`before_ready`) and never wait for
a capture; once an instance is ready they replay. All on the simulated GPU of
support/cuda_graph_fake.py (`GatedCaptureBackend` makes a capture as slow as a test needs);
each test ends with the leak check (`run`) and checks that every capture stream went back.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import sympy
import torch

from asyncgraph import BatchingConfig, Executor, GraphBuilder
from asyncgraph.cuda import capture as cuda_capture
from asyncgraph.cuda import graphs
from asyncgraph.cuda.capture import SignatureCapture
from asyncgraph.graph.ir import Graph, TensorSpec
from tests.support.backends import run, settle, until
from tests.support.cuda_graph_fake import (
    CaptureBackend,
    CaptureGpu,
    GatedCaptureBackend,
    diamond_graph,
    diamond_program,
    graph_instances,
    make_executor,
    stats,
    with_parameters,
)
from tests.support.fake_gpu import gpu_running

aten = torch.ops.aten
W = torch.full((4,), 2.0)


@pytest.fixture(autouse=True)
def _captures_wait_their_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine must not turn an inline capture into a timeout's fallback."""
    monkeypatch.setattr(graphs, "CAPTURE_WAIT_S", 30.0)


def expected(x: torch.Tensor, w: torch.Tensor = W) -> torch.Tensor:
    scaled = x * w
    return torch.relu(scaled) + torch.sigmoid(scaled)


def inputs(k: int, n: int = 4) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n) * (k + 1)


def count_thread_hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every `anyio.to_thread.run_sync` from now on appends to the returned list."""
    hops: list[int] = []
    hop = anyio.to_thread.run_sync

    async def counted(*args: Any, **kwargs: Any) -> Any:
        hops.append(1)
        return await hop(*args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    return hops


def status(ex: Executor) -> list[tuple[str, int]]:
    """Each signature's (state, instances), as statistics say."""
    return [(s.state, s.instances) for s in stats(ex).signatures]


class Probe:
    """A task that counts its turns on the loop: it runs only while the loop is free."""

    def __init__(self) -> None:
        self.turns = 0
        self.stop = anyio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            self.turns += 1
            await anyio.lowlevel.checkpoint()


# -- warm_up ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_first_execution_after_warm_up_replays(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """warm_up captures every instance the signature may have (2: two frames), with the
    signature's warm-up executions run on the capture thread: the executions after it
    replay at once, with no warm-up, no capture and no thread hop on the serving path."""
    hops = count_thread_hops(monkeypatch)

    async def body() -> None:
        gpu = CaptureGpu(seed=1)
        cuda = CaptureBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=2,
                           max_concurrent_executions=2)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        loop_thread = threading.get_ident()
        try:
            async with gpu_running(gpu):
                ready = await ex.warm_up(inputs(0))
                assert ready == [SignatureCapture("(float32[4] cpu)", "ready", 2)]
                s = stats(ex)
                assert (s.captures, s.captured_ahead, s.warmups, s.replays) == (2, 2, 0, 0), s
                assert loop_thread not in cuda.capture_threads  # captured on a thread
                assert len(gpu.warmed) > 0  # warmed on the capture streams, off the loop
                hopped = len(hops)
                for k in range(1, 4):
                    torch.testing.assert_close(await ex.execute(inputs(k)), expected(inputs(k)))
                s = stats(ex)
                assert (s.captures, s.replays, s.warmups, s.fallbacks, s.before_ready) == (
                    2, 3, 0, 0, 0), s
                assert len(hops) == hopped  # nothing captured on the serving path
                assert cuda_capture.CAPTURE_STREAMS.held > held_before
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert all(g.freed for g in cuda.graphs)
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_warm_up_of_an_uncaptured_program_captures_nothing(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=2)
        ex = make_executor(diamond_program(), gpu, graphs=False)
        async with gpu_running(gpu):
            assert await ex.warm_up(inputs(0)) == []
            await ex.aclose()

    run(body, backend)


# -- serving meanwhile -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_serving_during_a_slow_capture_ahead_takes_the_stream_path_and_never_blocks_the_loop(
    backend: str,
) -> None:
    """capture_ahead=True: the first execution of a signature queues its capture and runs on
    the stream path; while the capture is held on its thread, executions go on on the stream
    path (`before_ready`, none waits) and a probe task keeps getting turns on the loop; once
    it is ready, executions replay."""
    async def body() -> None:
        gpu = CaptureGpu(seed=3)
        cuda = GatedCaptureBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=2, capture_ahead=True,
                           max_concurrent_executions=2)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        probe = Probe()
        cuda.hold()
        try:
            async with gpu_running(gpu), anyio.create_task_group() as group:
                group.start_soon(probe.run)
                torch.testing.assert_close(await ex.execute(inputs(0)), expected(inputs(0)))
                await until(cuda.entered.is_set, "the capture ahead waits at its gate")
                assert status(ex) == [("capturing", 0)]
                turns = probe.turns
                for k in range(1, 4):
                    torch.testing.assert_close(await ex.execute(inputs(k)), expected(inputs(k)))
                await settle()
                assert probe.turns > turns  # the loop ran the probe while the capture waited
                s = stats(ex)
                assert (s.before_ready, s.captures, s.warmups, s.replays) == (4, 0, 0, 0), s
                assert s.instance_waits == 0  # nobody waited for the capture
                cuda.release()
                await until(lambda: status(ex) == [("ready", 1)], "the instance is ready")
                torch.testing.assert_close(await ex.execute(inputs(4)), expected(inputs(4)))
                s = stats(ex)
                assert (s.captures, s.captured_ahead, s.replays, s.before_ready) == (
                    1, 1, 1, 4), s
                probe.stop.set()
        finally:
            cuda.release()
            async with gpu_running(gpu):
                await ex.aclose()
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_with_capture_ahead_a_busy_signature_grows_an_instance_ahead(backend: str) -> None:
    """Two executions at once find the one instance busy: the second waits for its replay
    (a replay away, not a capture) and queues a second instance's capture ahead; the next
    pair both replay at once."""
    async def body() -> None:
        gpu = CaptureGpu(seed=4)
        cuda = CaptureBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=0, capture_ahead=True,
                           max_concurrent_executions=2)
        instances = graph_instances(ex)
        held_before = cuda_capture.CAPTURE_STREAMS.held

        async def call(k: int) -> None:
            torch.testing.assert_close(await ex.execute(inputs(k)), expected(inputs(k)))

        try:
            async with gpu_running(gpu):
                await call(0)  # queues the first instance's capture, runs uncaptured
                await until(lambda: status(ex) == [("ready", 1)], "the first instance")
            async with anyio.create_task_group() as group:  # the GPU paused: replays wait
                group.start_soon(call, 1)
                group.start_soon(call, 2)
                await until(lambda: instances.waiting == 1, "the second waits for the first")
                async with gpu_running(gpu):
                    await until(lambda: status(ex) == [("ready", 2)], "a second, ahead")
                    await until(lambda: ex.statistics().frames.in_use == 0, "both done")
            async with gpu_running(gpu), anyio.create_task_group() as group:
                group.start_soon(call, 3)
                group.start_soon(call, 4)
            s = stats(ex)
            assert (s.captures, s.captured_ahead, s.replays, s.before_ready) == (2, 2, 4, 1), s
            assert (s.instance_waits, s.warmups, s.fallbacks) == (1, 0, 0), s
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert gpu.errors == []

    run(body, backend)


# -- close and weights -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_closing_stops_a_capture_ahead_waiting_for_its_turn_and_frees_everything(
    backend: str,
) -> None:
    """While another capture holds the process's capture lock, the capture ahead waits on
    its thread; aclose stops it there (without the lock being released), drops the captures
    still queued, and gives every capture stream back; warm_up returns saying why."""
    async def body() -> None:
        gpu = CaptureGpu(seed=5)
        cuda = CaptureBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=1,
                           max_concurrent_executions=2)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        returned: list[list[Any]] = []

        async def warm() -> None:
            returned.append(await ex.warm_up(inputs(0)))

        async with gpu_running(gpu), anyio.create_task_group() as group:
            with cuda_capture.CAPTURE_LOCK:  # another capture records
                group.start_soon(warm)
                await until(lambda: status(ex) == [("capturing", 0)], "capturing")
                await ex.aclose()  # returns with the lock still held
                assert ex.statistics().closed
            await until(lambda: bool(returned), "warm_up returned")
        assert returned == [[SignatureCapture("(float32[4] cpu)", "uncaptured", 0,
                                              "the executor closed")]]
        s = stats(ex)
        assert (s.captures, s.captured_ahead, s.instances) == (0, 0, 0), s
        assert cuda.graphs == []  # stopped before anything was allocated for the capture
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_closing_during_a_capture_ahead_waits_for_it_and_frees_what_it_captured(
    backend: str,
) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=6)
        cuda = GatedCaptureBackend(gpu)
        ex = make_executor(diamond_program(), gpu, cuda, graph_warmup=1,
                           max_concurrent_executions=2)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        closed = anyio.Event()
        cuda.hold()

        async def close() -> None:
            async with gpu_running(gpu):
                await ex.aclose()
            closed.set()

        try:
            async with gpu_running(gpu), anyio.create_task_group() as group:
                group.start_soon(ex.warm_up, inputs(0))  # two instances: one held, one queued
                await until(cuda.entered.is_set, "the first capture at its gate")
                group.start_soon(close)
                await settle()
                assert not closed.is_set()  # aclose waits for the capture in progress
                cuda.release()
                await closed.wait()
        finally:
            cuda.release()
        s = stats(ex)
        assert (s.captures, s.instances, s.live_graphs) == (1, 0, 0), s  # the queued dropped
        assert len(cuda.graphs) == 1 and cuda.graphs[0].freed
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert gpu.errors == []

    run(body, backend)


@pytest.mark.timeout(60)
def test_a_weights_swap_during_a_capture_ahead_never_replays_old_weights(backend: str) -> None:
    """The capture ahead records the weights it was queued with; swapped meanwhile, its
    instance is freed by the first execution that leases it, which runs on the stream path
    on the new weights while the instance is recaptured ahead; then replays read them."""
    async def body() -> None:
        gpu = CaptureGpu(seed=7, track_writers=True)
        cuda = GatedCaptureBackend(gpu)
        old, new = W, torch.tensor([-1.0, 0.0, 1.0, 4.0])
        ex = make_executor(diamond_program(old), gpu, cuda, graph_warmup=1,
                           capture_ahead=True, max_concurrent_executions=1)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        cuda.hold()
        try:
            async with gpu_running(gpu), anyio.create_task_group() as group:
                group.start_soon(ex.warm_up, inputs(0))
                await until(cuda.entered.is_set, "the capture at its gate")
                ex.swap_weights({"w": new})
                cuda.release()
                await until(lambda: status(ex) == [("ready", 1)], "captured on old weights")
                first = cuda.graphs[0]
                # the stale instance goes back to be recaptured; this one runs uncaptured
                torch.testing.assert_close(await ex.execute(inputs(1)), expected(inputs(1), new))
                s = stats(ex)
                assert (s.recaptures, s.replays, s.before_ready) == (1, 0, 1), s
                assert first.freed and first.replays == 0  # never replayed on old weights
                await until(lambda: stats(ex).captured_ahead == 2, "recaptured ahead")
                for k in range(2, 4):
                    torch.testing.assert_close(await ex.execute(inputs(k)),
                                               expected(inputs(k), new))
                s = stats(ex)
                assert (s.recaptures, s.replays, s.captures, s.before_ready) == (1, 2, 2, 1), s
                assert first.replays == 0
        finally:
            cuda.release()
            async with gpu_running(gpu):
                await ex.aclose()
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert gpu.errors == []

    run(body, backend)


# -- batch buckets and failures --------------------------------------------------------------------


def _with_specs(graph: Graph, specs: dict[str, TensorSpec]) -> Graph:
    values = [
        dataclasses.replace(v, spec=specs[v.name]) if v.name in specs else v for v in graph.values
    ]
    return Graph(values, list(graph.nodes), graph.signature)


@pytest.mark.timeout(60)
def test_warm_up_captures_one_signature_per_batch_bucket(backend: str) -> None:
    """Batching pads to buckets (1, 2, 4): warm_up captures each bucket's signature, its
    inputs the example's rows repeated; then batches of every size replay, none captured on
    the serving path."""
    batch = sympy.Symbol("s0", positive=True, integer=True)
    rows = TensorSpec(torch.float32, torch.device("cuda"), (batch, 4), (4, 1))
    program = with_parameters(_with_specs(diamond_graph(), {"x": rows, "gpu_join": rows}),
                              {"w": W})

    async def body() -> None:
        gpu = CaptureGpu(seed=8)
        cuda = GatedCaptureBackend(gpu)
        # the fake's tensors are CPU tensors: validation would refuse them for a cuda spec
        ex = make_executor(program, gpu, cuda, graph_warmup=2, validate_inputs=False,
                           max_concurrent_executions=1,
                           batching=BatchingConfig(max_batch_size=4, buckets=(1, 2, 4)))
        assert ex.cuda_graph_plan is not None and ex.cuda_graph_plan.capturable
        held_before = cuda_capture.CAPTURE_STREAMS.held
        returned: list[list[SignatureCapture]] = []

        async def warm() -> None:
            returned.append(await ex.warm_up(inputs(0, 12).reshape(3, 4)))

        cuda.hold()
        try:
            async with gpu_running(gpu):
                async with anyio.create_task_group() as group:
                    group.start_soon(warm)
                    await until(cuda.entered.is_set, "the first bucket's capture")
                    assert status(ex) == [("capturing", 0), ("pending", 0), ("pending", 0)]
                    cuda.release()
                assert [(r.signature, r.state, r.instances) for r in returned[0]] == [
                    (f"(float32[{n}, 4] cpu)", "ready", 1) for n in (1, 2, 4)]
                assert stats(ex).captured_ahead == 3
                for n in (1, 2, 3, 4):
                    x = inputs(n, 4 * n).reshape(n, 4)
                    torch.testing.assert_close(await ex.execute(x), expected(x))
                s = stats(ex)
                assert (s.captures, s.replays, s.warmups, s.fallbacks) == (3, 4, 0, 0), s
        finally:
            cuda.release()
            async with gpu_running(gpu):
                await ex.aclose()
        assert cuda_capture.CAPTURE_STREAMS.held == held_before
        assert gpu.errors == []

    run(body, backend)


def syncing_graph() -> Graph:
    b = GraphBuilder()
    y = b.call(aten.relu.default, b.input("x"), name="gpu_relu")
    b.output(b.call(aten.clone.default, y, name="gpu_sync_check"))  # reads a GPU value inside
    return b.build()


@pytest.mark.timeout(60)
def test_a_capture_ahead_that_fails_says_why_and_serving_goes_on(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=9)
        cuda = CaptureBackend(gpu)
        ex = make_executor(syncing_graph(), gpu, cuda, graph_warmup=2, capture_ahead=True,
                           max_concurrent_executions=2)
        held_before = cuda_capture.CAPTURE_STREAMS.held
        try:
            async with gpu_running(gpu):
                [failed] = await ex.warm_up(inputs(0))
                assert failed.state == "failed" and failed.instances == 0
                assert failed.reason is not None
                assert "operation not permitted when stream is capturing" in failed.reason
                assert "gpu_sync_check" in failed.reason  # the node that broke it
                for k in range(1, 4):
                    torch.testing.assert_close(await ex.execute(inputs(k)),
                                               torch.relu(inputs(k)))
                s = stats(ex)
                assert (s.failures, s.captures, s.fallbacks, s.replays) == (1, 0, 3, 0), s
                assert [(c.state, c.reason) for c in s.signatures] == [("failed", failed.reason)]
                assert cuda_capture.CAPTURE_STREAMS.held == held_before  # freed at once
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert gpu.errors == []

    run(body, backend)


NINE_BUCKETS = tuple(range(1, cuda_capture.MAX_CAPTURES + 2))  # one more than 8 signatures


def _nine_bucket_executor(gpu: CaptureGpu, **config: Any) -> Executor:
    """The diamond on CUDA rows batched into NINE_BUCKETS, with `config` besides."""
    batch = sympy.Symbol("s0", positive=True, integer=True)
    rows = TensorSpec(torch.float32, torch.device("cuda"), (batch, 4), (4, 1))
    program = with_parameters(_with_specs(diamond_graph(), {"x": rows, "gpu_join": rows}),
                              {"w": W})
    return make_executor(
        program, gpu, validate_inputs=False,
        batching=BatchingConfig(max_batch_size=NINE_BUCKETS[-1], buckets=NINE_BUCKETS),
        **config)


@pytest.mark.timeout(60)
def test_warm_up_refuses_more_signatures_than_an_executor_keeps(backend: str) -> None:
    async def body() -> None:
        gpu = CaptureGpu(seed=10)
        ex = _nine_bucket_executor(gpu, max_captured_signatures=cuda_capture.MAX_CAPTURES)
        async with gpu_running(gpu):
            with pytest.raises(ValueError, match=r"asked for 9 input signatures.*keeps the "
                                                 r"graphs of 8 \(CudaConfig.max_captured"):
                await ex.warm_up(inputs(0).reshape(1, 4))
            await ex.aclose()
        assert stats(ex).captures == 0

    run(body, backend)


@pytest.mark.timeout(60)
def test_by_default_an_executor_keeps_two_batch_keys_worth_of_buckets(backend: str) -> None:
    """CudaConfig.max_captured_signatures=None: with batching into 9 buckets an Executor
    keeps 18 signatures, so warm_up captures every bucket and evicts none."""
    async def body() -> None:
        gpu = CaptureGpu(seed=11)
        ex = _nine_bucket_executor(gpu)
        async with gpu_running(gpu):
            try:
                captured = await ex.warm_up(inputs(0).reshape(1, 4))
                assert len(captured) == len(NINE_BUCKETS)
                assert all(c.state == "ready" for c in captured), captured
                assert stats(ex).evictions == 0
            finally:
                await ex.aclose()
        assert gpu.errors == []

    run(body, backend)


def test_the_signatures_kept_follow_the_buckets() -> None:
    from asyncgraph.runtime.batching import default_buckets
    from asyncgraph.runtime.config import CudaConfig, ExecutorConfig

    unbatched = ExecutorConfig(batching=None)
    assert cuda_capture.captured_signatures(unbatched) == cuda_capture.MAX_CAPTURES
    default = ExecutorConfig().batching  # batching where graphs are captured, by default
    assert default is not None
    assert cuda_capture.captured_signatures(ExecutorConfig()) == 2 * len(
        default_buckets(default.max_batch_size))
    batching = BatchingConfig(max_batch_size=32)
    assert len(default_buckets(32)) == 7
    assert cuda_capture.captured_signatures(ExecutorConfig(batching=batching)) == 14
    small = BatchingConfig(max_batch_size=2)
    assert cuda_capture.captured_signatures(
        ExecutorConfig(batching=small)) == cuda_capture.MAX_CAPTURES
    chosen = ExecutorConfig(batching=batching, cuda=CudaConfig(max_captured_signatures=3))
    assert cuda_capture.captured_signatures(chosen) == 3
    with pytest.raises(ValueError, match="max_captured_signatures"):
        CudaConfig(max_captured_signatures=0)
