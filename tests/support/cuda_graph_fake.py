"""A simulated GPU that can capture CUDA graphs, for tests/integration/test_cuda_graphs.py,
test_cuda_graph_segments.py and test_graph_instances.py.

It extends the simulated GPU of support/fake_gpu.py (fake in-order streams and events, a
current stream per thread: `ThreadGpu`) with what capture requires of the host, as CUDA enforces it:

- While a capture is open on a thread, an event query or synchronize and a host read of a GPU
  value from that thread raise ("operation not permitted when stream is capturing"); so does
  querying, later, an event whose last record was inside a capture.
- Work enqueued on a capturing stream is recorded into the graph instead of run. A stream joins
  the capture only by waiting on an event recorded inside it; a kernel launched from the
  capturing thread on a stream that has not joined raises; a captured stream waiting on an
  event recorded outside the capture raises (capture isolation); a stream with work after its
  last join when the capture ends raises (unjoined).
- Values are real CPU tensors computed on the host. A captured kernel does not compute: it
  returns a static output tensor, filled with NaN (or -999 for integer dtypes) until a replay,
  allocated in the capture's pool (`FakePool.allocations`), and records the work that writes
  it. `FakeGraph.replay` re-runs that work in order, reading the tensors it captured (static
  inputs and weights, by address) and writing the SAME static output tensors, and enqueues one
  marker kernel on the current stream that the simulated GPU must run before the replay counts
  as done. A caller handed a static output would see it overwritten by the next replay.
- With `track_writers=True`, kernels also check GPU order: each kernel needs the kernels that
  wrote the tensors it reads (the last kernel, or replay, that wrote each one) to have run
  before it; a violation is one of `gpu.errors`. Host-side copies (static inputs, clones) are
  not kernels of the fake: `adopt` attributes a copy to the writer of its source.

- Capture streams come from a pool of 32 per device handed out round-robin, as torch's
  high-priority pool is (`capture_streams_per_device`); `captured_on` and `capture_threads`
  say where each capture recorded.
- A capture CUDA cannot end (streams left unjoined) is counted in `failed_ends`: on torch that
  leaves the caching allocator in capture mode unless the backend gives the pool back.
- A kernel's first use of a (thread, stream) inside a capture counts as a library workspace
  allocated in the capture's pool (`FakePool.workspaces`), as cuBLAS allocates one per
  (handle, stream).
- What executions cost the host (`CaptureGpu.host`, a `HostCalls`): events made, event queries
  (and those on the event loop's thread: its polls), synchronizes; `capture_stream_requests`
  counts what capture-stream leases asked of the pool. With `eager=True` the GPU is idle by
  the time the host asks: a query first runs everything enqueued, so a wait's count of
  queries and hand-offs is exact.

What it cannot model: real kernels and their timing (a replay re-runs Python on the host);
the caching allocator itself (blocks kept for recorded streams, `empty_cache`, memory growth:
`make gpu-report`'s capture-failure probe measures those on a GPU); a capture invalidated
by a sync (CUDA then refuses to end it whatever was joined: the fake only refuses the
unjoined end); ops that sync inside (only the kernels named `gpu_sync*` read a GPU value on
the host); cuBLAS's actual workspace sharing between concurrent replays (only first uses
are counted); the loop's wake-up latency from a thread on a real machine (benchmarks/gpu_wait.py
--cuda measures it).

Also the Executor on it (`make_executor`, `running`, `stats`, `graph_instances`) and the
diamond program the test files run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from asyncgraph import Executor, GraphBuilder
from asyncgraph.cuda import capture as cuda_capture
from asyncgraph.cuda.instances import GraphInstances
from asyncgraph.graph.importers import Program
from asyncgraph.graph.ir import Graph, InputKind, Node, Signature
from asyncgraph.kernels import KernelFactory, KernelKind, OpKernel
from asyncgraph.runtime.config import CudaConfig
from tests.support.fake_gpu import (
    FakeBackend,
    FakeEvent,
    FakeStream,
    ThreadGpu,
    _on_event_loop,
    gpu_config,
    gpu_running,
)

NOT_PERMITTED = "operation not permitted when stream is capturing"


class FakePool:
    """A capture's private memory pool: what was allocated while its capture was open."""

    def __init__(self) -> None:
        self.allocations: list[torch.Tensor] = []
        # library state first allocated inside a capture (a cuBLAS workspace per (thread,
        # stream) on a real GPU): it would live in the graph's pool
        self.workspaces = 0


class FakeGraph:
    """A captured graph: the recorded work, replayed in order on the host."""

    def __init__(self, gpu: CaptureGpu) -> None:
        self.gpu = gpu
        self.work: list[Callable[[], None]] = []
        self.statics: list[torch.Tensor] = []  # the static outputs its work writes
        self.captured = False
        self.freed = False
        self.replays = 0

    def replay(self) -> None:
        gpu = self.gpu
        if not self.captured or self.freed:
            raise RuntimeError("replay of a graph that is not captured (or was reset)")
        if gpu.capturing() is not None:
            raise RuntimeError(NOT_PERMITTED)
        stream = gpu.current
        if stream is None:
            raise RuntimeError("replay outside a stream")
        with torch.inference_mode():  # GPU work: no autograd, static outputs of any mode
            for work in self.work:
                work()
        self.replays += 1
        marker = ("replay", id(self), self.replays)
        gpu.launch(marker, set(), stream)
        for static in self.statics:
            gpu.wrote(static, marker)

    def reset(self) -> None:
        self.freed = True
        self.work = []


@dataclasses.dataclass
class FakeCapture:
    graph: FakeGraph
    pool: FakePool
    origin: FakeStream
    thread: int
    streams: set[FakeStream]
    clock: itertools.count[int] = dataclasses.field(default_factory=itertools.count)
    last_work: dict[FakeStream, int] = dataclasses.field(default_factory=dict)
    joined: dict[FakeStream, int] = dataclasses.field(default_factory=dict)

    def touch(self, stream: FakeStream) -> int:
        tick = next(self.clock)
        self.last_work[stream] = tick
        return tick


@dataclasses.dataclass
class HostCalls:
    """What the host asked of the simulated GPU's events (`CaptureGpu.host`)."""

    events_made: int = 0
    queries: int = 0
    loop_queries: int = 0  # made on the thread that runs the event loop: its polls
    synchronizes: int = 0
    loop_synchronizes: int = 0


class CaptureGpu(ThreadGpu):
    """ThreadGpu with one capture open at a time, on the thread that opened it."""

    def __init__(self, seed: int = 0, track_writers: bool = False, eager: bool = False) -> None:
        super().__init__(seed)
        self.capture: FakeCapture | None = None
        self.captures = 0
        self.track_writers = track_writers
        self.eager = eager  # idle by the time the host asks: a query runs what is enqueued
        self.host = HostCalls()
        self.warmed: set[tuple[int, FakeStream]] = set()  # (thread, stream) that launched
        self._writers: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def wrote(self, value: Any, kernel: Any) -> None:
        """`kernel` (a launched kernel's name) is the last writer of the tensors in `value`."""
        if not self.track_writers:
            return
        if isinstance(value, torch.Tensor):
            self._writers[id(value)] = (weakref.ref(value), kernel)
        elif isinstance(value, (list, tuple)):
            for item in value:
                self.wrote(item, kernel)

    def writer(self, tensor: Any) -> Any:
        """The last kernel that wrote `tensor`, or None (an input, a weight, untracked)."""
        entry = self._writers.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1]

    def adopt(self, copy: Any, source: Any) -> None:
        """A copy made on the stream right after `source`'s writer: the same writer."""
        kernel = self.writer(source)
        if kernel is not None and isinstance(copy, torch.Tensor):
            self.wrote(copy, kernel)

    def needs(self, args: Any) -> set[Any]:
        """The writers of the tensors in `args` (nested lists and tuples)."""
        if not self.track_writers:
            return set()
        out: set[Any] = set()
        stack = list(args)
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, torch.Tensor) and (kernel := self.writer(item)) is not None:
                out.add(kernel)
        return out

    def capturing(self) -> FakeCapture | None:
        """The capture open on the calling thread, if any."""
        capture = self.capture
        if capture is not None and capture.thread == threading.get_ident():
            return capture
        return None

    def host_read(self, what: str) -> None:
        """A host read of a GPU value (`.item()`, a sync inside an op)."""
        if self.capturing() is not None:
            raise RuntimeError(f"{what}: {NOT_PERMITTED}")


class CaptureEvent(FakeEvent):
    def __init__(self, gpu: CaptureGpu) -> None:
        super().__init__(gpu)
        self.captured: tuple[FakeCapture, FakeStream, int] | None = None

    def record(self, stream: FakeStream) -> None:
        gpu = self.gpu
        assert isinstance(gpu, CaptureGpu)
        capture = gpu.capturing()
        if capture is not None and stream in capture.streams:
            self.captured = (capture, stream, capture.touch(stream))
            self.token = None
            return
        self.captured = None
        super().record(stream)

    def _check(self) -> None:
        gpu = self.gpu
        assert isinstance(gpu, CaptureGpu)
        if gpu.capturing() is not None:
            raise RuntimeError(NOT_PERMITTED)
        if self.captured is not None:
            raise RuntimeError("query of an event recorded inside a capture")

    def query(self) -> bool:
        gpu = self.gpu
        assert isinstance(gpu, CaptureGpu)
        gpu.host.queries += 1
        if _on_event_loop():
            gpu.host.loop_queries += 1
        self._check()
        if gpu.eager:
            gpu.drain()
        return super().query()

    def synchronize(self) -> None:
        gpu = self.gpu
        assert isinstance(gpu, CaptureGpu)
        gpu.host.synchronizes += 1
        if _on_event_loop():
            gpu.host.loop_synchronizes += 1
        self._check()
        if gpu.eager:
            gpu.drain()
        if not FakeEvent.query(self):  # FakeEvent.synchronize, its queries not the host's
            assert not _on_event_loop(), "synchronize() on a pending event would block the loop"
            gpu.wait_until(lambda: FakeEvent.query(self))
        self.synchronized += 1


class CaptureStream(FakeStream):
    def wait_event(self, event: FakeEvent) -> None:
        gpu = self.gpu
        assert isinstance(gpu, CaptureGpu)
        capture = gpu.capturing()
        captured = getattr(event, "captured", None)
        if capture is not None and captured is not None and captured[0] is capture:
            capture.streams.add(self)  # joins the capture (a fork, or a join on the origin)
            if self is capture.origin:
                _, stream, tick = captured
                capture.joined[stream] = tick
            capture.touch(self)
            return
        if capture is not None and self in capture.streams:
            raise RuntimeError("a capturing stream waited on an event from outside the capture")
        super().wait_event(event)


class CaptureBackend(FakeBackend):
    """FakeBackend with capture (streams and events above; graphs, pools, capture)."""

    def __init__(self, gpu: CaptureGpu, capture_streams_per_device: int = 32) -> None:
        super().__init__(gpu)
        self.graphs: list[FakeGraph] = []
        self.pools: list[FakePool] = []
        # torch's pool of high-priority streams: 32 per device, handed out round-robin
        self.capture_streams_per_device = capture_streams_per_device
        self._capture_pool: dict[int, list[FakeStream]] = {}
        self._capture_next: dict[int, int] = {}
        self.captured_on: list[FakeStream] = []  # each capture's origin stream, in order
        self.capture_threads: list[int] = []  # and the thread that captured it
        self.capture_stream_requests = 0  # new_capture_stream calls: lease attempts' cost
        # captures CUDA could not end (streams left unjoined): on torch, the allocator stays
        # in capture mode unless the backend gives the pool back (TorchCudaBackend)
        self.failed_ends = 0

    def new_stream(self, device: int) -> FakeStream:
        stream = CaptureStream(self.gpu, f"d{device}#{len(self.gpu.streams)}")
        self.gpu.streams.append(stream)
        return stream

    def new_capture_stream(self, device: int) -> FakeStream:
        """Named `cap...`: tests check that captures record only on these. As torch's
        pool does, the first 32 calls per device make streams and later calls hand them out
        again, round-robin."""
        self.capture_stream_requests += 1
        pool = self._capture_pool.setdefault(device, [])
        if len(pool) < self.capture_streams_per_device:
            stream = CaptureStream(self.gpu, f"cap{device}#{len(self.gpu.streams)}")
            self.gpu.streams.append(stream)
            pool.append(stream)
            return stream
        turn = self._capture_next.get(device, 0)
        self._capture_next[device] = turn + 1
        return pool[turn % len(pool)]

    def new_event(self) -> CaptureEvent:
        assert isinstance(self.gpu, CaptureGpu)
        self.gpu.host.events_made += 1
        return CaptureEvent(self.gpu)

    def new_graph(self) -> FakeGraph:
        assert isinstance(self.gpu, CaptureGpu)
        graph = FakeGraph(self.gpu)
        self.graphs.append(graph)
        return graph

    def graph_pool(self) -> FakePool:
        pool = FakePool()
        self.pools.append(pool)
        return pool

    @contextlib.contextmanager
    def capture(self, graph: FakeGraph, pool: FakePool, handle: FakeStream) -> Iterator[None]:
        gpu = self.gpu
        assert isinstance(gpu, CaptureGpu)
        if gpu.capture is not None:
            raise RuntimeError("a capture is already open")
        token = self.enter_stream(handle)
        self.captured_on.append(handle)
        self.capture_threads.append(threading.get_ident())
        gpu.capture = capture = FakeCapture(
            graph, pool, handle, threading.get_ident(), {handle}
        )
        try:
            try:
                yield
            except BaseException:
                if self._unjoined(capture, handle):  # CUDA cannot end it: the end fails too
                    self.failed_ends += 1
                raise
            unjoined = self._unjoined(capture, handle)
            if unjoined:
                self.failed_ends += 1
                raise RuntimeError(f"capture ended with unjoined streams {unjoined}")
            graph.captured = True
            gpu.captures += 1
        finally:
            gpu.capture = None
            self.leave_stream(token)

    @staticmethod
    def _unjoined(capture: FakeCapture, origin: FakeStream) -> list[FakeStream]:
        return [
            s for s, tick in capture.last_work.items()
            if s is not origin and capture.joined.get(s, -1) < tick
        ]


class GatedCaptureBackend(CaptureBackend):
    """CaptureBackend whose captures are slow at will: each capture, on its thread, sets
    `entered` and then waits for `gate` before it records anything (tests/integration/
    test_capture_ahead.py: what serving does while a capture ahead takes its time). The gate
    starts open; `hold()` closes it, `release()` opens it. A capture that waits longer than
    `timeout_s` raises, so a test that forgets to release cannot hang."""

    def __init__(self, gpu: CaptureGpu, capture_streams_per_device: int = 32,
                 timeout_s: float = 30.0) -> None:
        super().__init__(gpu, capture_streams_per_device)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.timeout_s = timeout_s

    def hold(self) -> None:
        self.entered.clear()
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    @contextlib.contextmanager
    def capture(self, graph: FakeGraph, pool: FakePool, handle: FakeStream) -> Iterator[None]:
        self.entered.set()
        if not self.gate.wait(self.timeout_s):
            raise RuntimeError(f"the capture waited {self.timeout_s} s for its gate")
        with super().capture(graph, pool, handle):
            yield


def fake_kernel(
    gpu: CaptureGpu, fn: Callable[..., Any], name: str, syncs: bool = False
) -> Callable[..., Any]:
    """A CUDA node's kernel on the simulated GPU: run at once (a marker kernel on the current
    stream), or recorded into the open capture, returning a static output."""
    ids = itertools.count()

    def kernel(*args: Any, **kwargs: Any) -> Any:
        stream = gpu.current
        if stream is None:
            raise RuntimeError(f"{name} ran outside its stream")
        if syncs:
            gpu.host_read(name)
        capture = gpu.capturing()
        used = (threading.get_ident(), stream)
        if capture is None:
            gpu.warmed.add(used)
            launched = ("k", name, next(ids))
            gpu.launch(launched, gpu.needs((*args, *kwargs.values())))
            result = fn(*args, **kwargs)
            gpu.wrote(result, launched)
            return result
        if stream not in capture.streams:
            raise RuntimeError(f"{name} launched on {stream!r}, which did not join the capture")
        capture.touch(stream)
        if used not in gpu.warmed:  # a library's per-(thread, stream) state, made in the pool
            gpu.warmed.add(used)
            capture.pool.workspaces += 1
        shape = fn(*args, **kwargs)  # for the output's shape and dtype only
        static = torch.full_like(shape, float("nan") if shape.is_floating_point() else -999)
        capture.pool.allocations.append(static)
        capture.graph.statics.append(static)

        def work() -> None:
            static.copy_(fn(*args, **kwargs))

        capture.graph.work.append(work)
        return static

    return kernel


class FakeCudaOps(KernelFactory):
    """aten nodes named `gpu*` are CUDA kernels of the simulated GPU; `gpu_sync*` ones read a
    GPU value on the host inside (an op that syncs, which capture refuses)."""

    def __init__(self, gpu: CaptureGpu) -> None:
        super().__init__()
        self.gpu = gpu

    def kernel_for(self, node: Node, graph: Graph) -> OpKernel | None:
        kernel = super().kernel_for(node, graph)
        if kernel is not None and node.name.startswith("gpu"):
            fn = fake_kernel(self.gpu, kernel.fn, node.name, node.name.startswith("gpu_sync"))
            return OpKernel(fn, KernelKind.DEVICE, kernel.name, cost=1000, device_type="cuda")
        return kernel


def with_parameters(graph: Graph, weights: dict[str, torch.Tensor]) -> Program:
    """`graph` with the user inputs named like `weights`' keys turned into parameters."""
    inputs = tuple(
        dataclasses.replace(spec, kind=InputKind.PARAMETER, target=graph.values[spec.value].name)
        if graph.values[spec.value].name in weights else spec
        for spec in graph.signature.inputs
    )
    signature = Signature(inputs, graph.signature.outputs, None, graph.signature.out_spec)
    return Program(Graph(list(graph.values), list(graph.nodes), signature), dict(weights))


aten = torch.ops.aten


def diamond_graph() -> Graph:
    """x * w, then relu and sigmoid on two streams, joined: a fork and a join in the capture."""
    b = GraphBuilder()
    x, w = b.input("x"), b.input("w")
    scaled = b.call(aten.mul.Tensor, x, w, name="gpu_scale")
    left = b.call(aten.relu.default, scaled, name="gpu_left")
    right = b.call(aten.sigmoid.default, scaled, name="gpu_right")
    b.output(b.call(aten.add.Tensor, left, right, name="gpu_join"))
    return b.build()


def diamond_program(w: torch.Tensor | None = None) -> Program:
    return with_parameters(diamond_graph(), {"w": torch.full((4,), 2.0) if w is None else w})


def make_executor(
    program: Program | Graph, gpu: CaptureGpu, backend: CaptureBackend | None = None,
    **config: Any,
) -> Executor:
    return Executor(
        program,
        gpu_config(CudaConfig(graphs=True), **config),
        kernel_factory=FakeCudaOps(gpu),
        _cuda_backend=backend or CaptureBackend(gpu),
    )


@contextlib.asynccontextmanager
async def running(ex: Executor, gpu: CaptureGpu) -> AsyncIterator[Executor]:
    """The GPU running for the block; the Executor closed with the GPU running."""
    try:
        async with gpu_running(gpu):
            yield ex
    finally:
        async with gpu_running(gpu):
            await ex.aclose()


def stats(ex: Executor) -> cuda_capture.CudaGraphStatistics:
    s = ex.cuda_graph_statistics()
    assert s is not None
    return s


def graph_instances(ex: Executor) -> GraphInstances:
    """The Executor's graph instances (asyncgraph/cuda/instances.py), white-box: its device
    plan's CUDA-graph state, which the Executor keeps under a private name."""
    instances = ex._device.graphs.instances  # type: ignore[attr-defined]
    assert isinstance(instances, GraphInstances)
    return instances
