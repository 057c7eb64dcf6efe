"""The simulated GPU of the CUDA tests: fake in-order streams and events, and what drives them.

- `FakeGpu`: streams run in order; each step advances one random runnable stream by one op, so
  streams interleave at random (`step_stream` advances one given stream); a kernel that runs
  before a kernel it needs is one of `gpu.errors`. `FakeEvent` and `FakeStream` are its events
  and streams, `FakeBackend` the cuda layer's Backend over it (asyncgraph.cuda.device),
  counting stream switches. An event's `synchronize` blocks its thread until the simulation
  has run the event's record, as cudaEventSynchronize does (the host-wait thread of
  asyncgraph/cuda/host_wait.py blocks there; `gpu.sync_waits` counts such waits); on the event
  loop's thread, which drives the simulation, a pending event is an error instead.
  `gpu.loop_queries` counts the queries made on an event loop's thread: the loop's polls.
- `ThreadGpu`: the fake GPU with a current stream per thread, as torch.cuda's.
- `Sim` makes node callables for builder graphs on a ThreadGpu (`FakeCudaTensor` values: the
  data, computed at once, and the kernel that writes it); `CudaNodes` marks the `gpu*` nodes
  CUDA kernels. `FaultyBackend`'s events raise once the GPU has faulted.
- `gpu_running`: the simulated GPU making progress in the background, on any anyio backend.
- `RecordingCuda`: torch's CUDA C functions, as `TorchCudaBackend` calls them, on a fake
  two-device machine.

Used by tests/integration/test_streams.py, test_gpu_executor.py, test_trio_gpu.py,
test_cuda_graphs.py, test_host_wait.py, test_gpu_waits.py and support/cuda_graph_fake.py
(which adds capture).

Not modelled: the wall time of GPU work and of the loop's timers (asyncio's selector loop and
trio round a timeout above zero up to 1 ms); tests assert what a wait does (which thread
waits, which timers it asks for), never how long it takes. benchmarks/gpu_wait.py times the
host wait on events that complete at a set time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import sys
import threading
import time
import types
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.lowlevel

from asyncgraph import ExecutorConfig
from asyncgraph.cuda.device import CudaFunctions
from asyncgraph.graph.ir import Graph, Node
from asyncgraph.kernels import KernelFactory, KernelKind, OpKernel
from asyncgraph.runtime.config import CudaConfig


class FakeEvent:
    """A CUDA event: `record` enqueues a marker; `query` is true once the marker has run;
    `synchronize` blocks a thread until then (the loop's thread must never block)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.token: int | None = None
        self.synchronized = 0

    def record(self, stream: FakeStream) -> None:
        # the token is published only once its marker is queued: a stream told to wait for
        # this event from another thread in between would otherwise wait for a marker that
        # is not on any stream yet, which the simulator (stepping meanwhile) calls a deadlock
        token = self.gpu.new_token()
        stream.queue.append(("record", token))
        self.token = token

    def query(self) -> bool:
        if on_event_loop():
            self.gpu.loop_queries += 1  # the loop's polls (cuda/device.py's wait_events)
        # a broken (deadlocked) simulation completes everything, so the test ends and reports
        return self.token is None or self.token in self.gpu.done_tokens or self.gpu.broken

    def synchronize(self) -> None:
        """Block until the event has completed, as cudaEventSynchronize does: on a thread
        other than the event loop's (the waiter thread of cuda/host_wait.py), since the loop
        drives the simulated GPU; on the loop's thread a pending event is an error (it would
        block the host forever). Raises what `query` raises (FaultyEvent's CUDA error)."""
        if not self.query():
            assert not on_event_loop(), "synchronize() on a pending event would block the loop"
            self.gpu.wait_until(self.query)
        self.synchronized += 1


class FakeStream:
    """An in-order queue of records, waits and kernels."""

    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu = gpu
        self.name = name
        self.queue: deque[tuple[Any, ...]] = deque()

    def wait_event(self, event: FakeEvent) -> None:
        self.queue.append(("wait", event.token))  # waits for the record made before the call

    def wait_stream(self, other: FakeStream) -> None:
        event = FakeEvent(self.gpu)
        event.record(other)
        self.wait_event(event)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


RECHECK_S = 0.005
"""How often a thread blocked in FakeEvent.synchronize looks again without being woken."""


def on_event_loop() -> bool:
    """Whether the calling thread runs an event loop (asyncio, uvloop or trio)."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        trio = sys.modules.get("trio")
        return trio is not None and bool(trio.lowlevel.in_trio_run())


_on_event_loop = on_event_loop  # the name support/cuda_graph_fake.py imports


DEADLOCK_AFTER_S = 5.0
"""How long the simulated GPU may see every non-empty stream waiting before it calls that a
deadlock (FakeGpu.step)."""


class FakeGpu:
    """Streams run in order; at each step one random runnable stream advances by one op."""

    def __init__(self, seed: int = 0, devices: int = 2) -> None:
        self.rng = random.Random(seed)
        self.streams: list[FakeStream] = []
        self.default = [self.stream(f"default{d}") for d in range(devices)]
        self.current: FakeStream | None = None
        self.done_tokens: set[int] = set()
        self.done_kernels: set[Any] = set()
        self.launched: set[Any] = set()
        self.errors: list[str] = []
        self._tokens = itertools.count(1)
        self._step_lock = threading.RLock()
        self._stuck_since: float | None = None
        # threads blocked in FakeEvent.synchronize, woken when a record (or an error) happens
        self._progress = threading.Condition(threading.Lock())
        self._sleepers = 0
        self._generation = 0
        self.sync_waits = 0  # synchronize() calls that blocked (the waiter thread's)
        self.loop_queries = 0  # event queries made on an event loop's thread: the loop's polls

    def stream(self, name: str) -> FakeStream:
        s = FakeStream(self, name)
        self.streams.append(s)
        return s

    def new_token(self) -> int:
        return next(self._tokens)  # atomic: worker threads record events too (ThreadGpu)

    def launch(self, name: Any, needs: set[Any], stream: FakeStream | None = None) -> None:
        target = stream or self.current or self.default[0]
        self.launched.add(name)
        target.queue.append(("kernel", name, frozenset(needs)))

    def runnable(self) -> list[FakeStream]:
        out = []
        for s in self.streams:
            if s.queue:
                op = s.queue[0]
                if op[0] != "wait" or op[1] is None or op[1] in self.done_tokens:
                    out.append(s)
        return out

    def step(self) -> bool:
        """Run one op of a random runnable stream; False when none can run. Work enqueued by
        threads is seen at any moment, so "nothing can run" is a deadlock only once it has
        lasted DEADLOCK_AFTER_S with no op run (a thread between two enqueues, preempted on a
        loaded machine, leaves that state for a moment)."""
        with self._step_lock:  # the loop and EagerEvent.query on worker threads both step
            ready = self.runnable()
            if not ready:
                if any(s.queue for s in self.streams) and not self.errors:
                    now = time.monotonic()
                    self._stuck_since = self._stuck_since or now
                    if now - self._stuck_since > DEADLOCK_AFTER_S:
                        self.errors.append("deadlock: every non-empty stream waits")
                        self._progressed()  # broken: every event counts as complete
                return False
            self._stuck_since = None
            self._run_op(self.rng.choice(ready))
            return True

    def step_stream(self, stream: FakeStream) -> bool:
        """Run the next op of `stream` alone; False when it has none or it waits (a test
        that completes one event and leaves another pending)."""
        with self._step_lock:
            if stream not in self.runnable():
                return False
            self._run_op(stream)
            return True

    def _run_op(self, stream: FakeStream) -> None:
        op = stream.queue.popleft()
        if op[0] == "record":
            self.done_tokens.add(op[1])
            self._progressed()
        elif op[0] == "kernel":
            missing = op[2] - self.done_kernels
            if missing:
                self.errors.append(f"kernel {op[1]} ran before {sorted(map(str, missing))}")
            self.done_kernels.add(op[1])

    @property
    def broken(self) -> bool:
        return bool(self.errors)

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Block the calling thread until `done()` (an event's query) is true: woken by each
        record the simulation runs, and at least every RECHECK_S (a fault or an error set
        from outside the simulation). `done` runs without the condition's lock held: an
        EagerEvent's query steps the GPU, which takes the step lock and then this one."""
        self.sync_waits += 1
        while True:
            seen = self._generation
            if done():
                return
            with self._progress:
                self._sleepers += 1
                try:
                    if self._generation == seen:  # no record ran since `done` was asked
                        self._progress.wait(RECHECK_S)
                finally:
                    self._sleepers -= 1

    def _progressed(self) -> None:
        """A record ran (or the simulation broke): wake the threads in `wait_until`. The
        generation is bumped before the sleepers are read, and a sleeper counts itself
        before it reads the generation, so one of the two sees the other."""
        self._generation += 1
        if self._sleepers:
            with self._progress:
                self._progress.notify_all()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for _ in range(self.rng.randint(0, 3)):
                self.step()
            await asyncio.sleep(0)


class FakeBackend:
    """The Backend of the simulated GPU; counts what an execution costs the host: stream
    switches (`switches`: a set of the current stream, entering or leaving), `enters`
    (units enqueued through the layer), `host_stream_calls` (the per-execution queries of
    the host's streams: torch.cuda's Python helpers in the real backend)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.recorded: list[tuple[Any, FakeStream]] = []
        self.switches = 0
        self.enters = 0
        self.host_stream_calls = 0

    def new_stream(self, device: int) -> FakeStream:
        return self.gpu.stream(f"d{device}#{len(self.gpu.streams)}")

    def new_capture_stream(self, device: int) -> FakeStream:
        return self.gpu.stream(f"cap{device}#{len(self.gpu.streams)}")

    def new_event(self) -> FakeEvent:
        return FakeEvent(self.gpu)

    def stream_handle(self, stream: FakeStream) -> FakeStream:
        return stream

    def enter_stream(self, handle: FakeStream) -> Any:
        self.enters += 1
        previous = self.gpu.current
        if previous is handle:
            return _SAME
        self.gpu.current = handle
        self.switches += 1
        return previous

    def leave_stream(self, token: Any) -> None:
        if token is not _SAME:
            self.gpu.current = token
            self.switches += 1

    def host_streams(self, device: int) -> list[FakeStream]:
        self.host_stream_calls += 1
        return [self.gpu.default[device]]

    def record_stream(self, value: Any, stream: FakeStream) -> None:
        self.recorded.append((value, stream))


_SAME = object()  # FakeBackend.enter_stream's token when the stream was current already


class ThreadGpu(FakeGpu):
    """The fake GPU with a current stream per thread, as torch.cuda's: CUDA units may be
    enqueued from worker threads while the loop enqueues others."""

    def __init__(self, seed: int = 0) -> None:
        self._local = threading.local()
        super().__init__(seed, devices=1)

    @property  # type: ignore[override]
    def current(self) -> FakeStream | None:
        stream: FakeStream | None = getattr(self._local, "stream", None)
        return stream

    @current.setter
    def current(self, stream: FakeStream | None) -> None:
        self._local.stream = stream

    def drain(self) -> None:
        while self.step():
            pass

    def pending_kernels(self) -> set[Any]:
        """Kernels of CUDA nodes enqueued and not yet run."""
        return {k for k in self.launched if k[0] == "k"} - self.done_kernels


class FaultyEvent(FakeEvent):
    """An event whose query reports a CUDA error once the GPU has faulted, as cudaEventQuery
    reports an earlier kernel's illegal memory access."""

    def query(self) -> bool:
        if getattr(self.gpu, "fault", False):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().query()


class FaultyBackend(FakeBackend):
    def new_event(self) -> FaultyEvent:
        return FaultyEvent(self.gpu)


class FakeCudaTensor:
    """A value on the simulated GPU: `data` (computed at once) and the kernel writing it."""

    __slots__ = ("data", "writer")

    def __init__(self, data: Any, writer: Any) -> None:
        self.data = data
        self.writer = writer

    def __repr__(self) -> str:
        return f"FakeCudaTensor({self.data!r}, writer={self.writer!r})"


def unwrap(value: Any) -> Any:
    return value.data if isinstance(value, FakeCudaTensor) else value


class Sim:
    """Makes node callables for the simulated GPU and records where host nodes ran."""

    def __init__(self, gpu: ThreadGpu) -> None:
        self.gpu = gpu
        self.ids = itertools.count()
        self.host_threads: dict[str, str] = {}

    def kernel(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A CUDA node: enqueue a kernel that needs the writers of its inputs."""

        def enqueue(*args: Any) -> FakeCudaTensor:
            assert self.gpu.current is not None, "a CUDA node ran outside its stream"
            needs = {a.writer for a in args if isinstance(a, FakeCudaTensor)}
            name = ("k", fn.__name__, next(self.ids))
            self.gpu.launch(name, needs)
            return FakeCudaTensor(fn(*map(unwrap, args)), name)

        enqueue.raw = fn  # type: ignore[attr-defined]
        return enqueue

    def host(self, fn: Callable[..., Any], makes_gpu_tensor: bool = False) -> Callable[..., Any]:
        """A CPU node: reads GPU values (they must have been written by then); with
        `makes_gpu_tensor` it returns a GPU tensor made on its thread's current stream."""

        def run(*args: Any) -> Any:
            self._check_reads(fn.__name__, args)
            out = fn(*map(unwrap, args))
            if makes_gpu_tensor:
                name = ("h", fn.__name__, next(self.ids))
                self.gpu.launch(name, set())  # no stream set: the default stream
                return FakeCudaTensor(out, name)
            return out

        run.raw = fn  # type: ignore[attr-defined]
        return run

    def host_async(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """An async CPU node (a task on the loop) reading GPU values."""

        async def run(*args: Any) -> Any:
            await asyncio.sleep(0)
            self._check_reads(fn.__name__, args)
            return fn(*map(unwrap, args))

        run.raw = fn  # type: ignore[attr-defined]
        return run

    def _check_reads(self, name: str, args: tuple[Any, ...]) -> None:
        self.host_threads[name] = threading.current_thread().name
        for a in args:
            written = not isinstance(a, FakeCudaTensor) or a.writer[0] != "k" or (
                a.writer in self.gpu.done_kernels
            )
            if not written:
                self.gpu.errors.append(f"host node {name} read {a.writer} before it ran")

    def upload(self, data: Any) -> FakeCudaTensor:
        """A caller's input, still being written on the caller's (default) stream."""
        name = ("in", next(self.ids))
        self.gpu.launch(name, set(), self.gpu.default[0])
        return FakeCudaTensor(data, name)


CUDA_FIELDS = frozenset(f.name for f in dataclasses.fields(CudaConfig))


def gpu_config(cuda: CudaConfig | None = None, **config: Any) -> ExecutorConfig:
    """The ExecutorConfig of a simulated-GPU test: adaptive placement off, and CudaConfig's
    fields (`streams`, `graphs`, `graph_warmup`) given by their own names beside
    ExecutorConfig's, set in `cuda` (the defaults when None)."""
    cuda_fields = {name: config.pop(name) for name in CUDA_FIELDS & config.keys()}
    cuda = dataclasses.replace(cuda or CudaConfig(), **cuda_fields)
    return ExecutorConfig(**{"adaptive_placement": False, **config}, cuda=cuda)


class CudaNodes(KernelFactory):
    """Builder graphs' kernels, with every node named `gpu*` a CUDA kernel, as an aten op on
    a CUDA tensor is (so its placement is DEVICE)."""

    def kernel_for(self, node: Node, graph: Graph) -> OpKernel | None:
        kernel = super().kernel_for(node, graph)
        if kernel is not None and node.name.startswith("gpu"):
            return OpKernel(kernel.fn, KernelKind.DEVICE, kernel.name, cost=1000,
                            device_type="cuda")
        return kernel


async def _steps(gpu: ThreadGpu, stop: anyio.Event) -> None:
    """The simulated GPU's progress: a few ops per loop turn, in a random stream order."""
    while not stop.is_set():
        for _ in range(gpu.rng.randint(0, 3)):
            gpu.step()
        await anyio.lowlevel.checkpoint()


@contextlib.asynccontextmanager
async def gpu_running(gpu: ThreadGpu) -> AsyncIterator[None]:
    """The simulated GPU making progress in the background until the block ends (any
    backend: anyio's task group; test_gpu_executor.py keeps an asyncio one of its own)."""
    stop = anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(_steps, gpu, stop)
        try:
            yield
        finally:
            stop.set()


class RecordingCuda:
    """torch's CUDA C functions as `TorchCudaBackend` calls them, on a fake two-device
    machine: a current device and a current stream per device, and a log of every call."""

    def __init__(self) -> None:
        self.device = 0
        self.current = {0: (0, 0, 1), 1: (0, 1, 1)}  # the default streams: id 0
        self.log: list[tuple[Any, ...]] = []

    def functions(self) -> CudaFunctions:
        def get_current(device: int) -> tuple[int, int, int]:
            self.log.append(("get_current", device))
            return self.current[device]

        def get_default(device: int) -> tuple[int, int, int]:
            self.log.append(("get_default", device))
            return (0, device, 1)

        def set_stream(stream_id: int, device_index: int, device_type: int) -> None:
            self.log.append(("set_stream", stream_id, device_index))
            self.current[device_index] = (stream_id, device_index, device_type)
            self.device = device_index  # as torch's _cuda_setStream does

        def get_device() -> int:
            self.log.append(("get_device",))
            return self.device

        def set_device(device: int) -> None:
            self.log.append(("set_device", device))
            self.device = device

        def make_stream(**kwargs: Any) -> Any:
            return types.SimpleNamespace(**kwargs)

        return CudaFunctions(
            get_current, get_default, set_stream, get_device, set_device, make_stream,
            lambda: None,
        )
