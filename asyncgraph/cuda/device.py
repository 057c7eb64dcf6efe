"""The thin torch.cuda layer that carries out a StreamPlan (GPU execution on CUDA streams).

What it does, and why:

- `StreamPool`: one Executor's stream sets. A set is `streams_per_device` streams on each
  device the plan uses. A running execution leases a set, so concurrent executions enqueue on
  different streams and overlap on the GPU; when more executions run than sets exist, the
  least-used set is shared (correct, because every cross-stream order is an event, only with
  less overlap). Streams come from torch's pool (32 per device and priority), so sets beyond
  that share hardware streams.
- `FrameStreams`: the GPU state of one execution frame, reused by its executions: a node's
  event, the end-of-stream events, and the leased set. `run` enqueues one node's kernel with
  `s` as the thread's current stream after `s.wait_event(e)` for its cross-stream producers,
  calls `record_stream` for tensors made on another stream, and records the node's event;
  `run_unit` does the same for a fused run of consecutive CUDA nodes on one stream, switching
  the stream once for the run (schedule.py compiles the run, with the waits, events and
  record_stream calls only where the plan has them). The host never waits there.
- Host cost: a stream switch is the backend's lowest level (for torch, the C functions
  `_cuda_getCurrentStream` / `_cuda_setStream` on cached stream ids, `CudaFunctions`), done
  only when the stream differs from the current one, never `torch.cuda.stream(...)` or
  `torch.cuda.current_stream()`, whose Python device-index helpers cost more than the launch.
- `wait_events`: the host's wait. It polls `event.query()` from the event loop between
  zero-timeout checkpoints, so a short GPU step is caught exactly and the loop never blocks on
  the GPU: for `PollPolicy.spin_s`, or, where the waits of the same place (`WaitSite`: a host
  node's inputs, an execution's end) have been measured to last up to `spin_max_s`, until a
  little past that. The events still pending then go to the process's waiter thread
  (cuda/host_wait.py), which blocks in `event.synchronize()` (the GIL released) and wakes the
  awaiting task through the loop's `call_soon_threadsafe` (asyncio, uvloop) or trio's token;
  for a site whose waits last longer, the loop polls again near their expected end (a loop
  timer starts that, well before the end), so that it sees the end without waiting for the
  thread's wake. No timer decides when a wait returns: asyncio's selector loop and trio round
  any timeout above zero up to 1 ms, which the sleeping poll of before paid on every wait
  (issue 36, item 1). The loop polls only while no other wait is outstanding: with another
  one in flight a wait hands off after its first query, so many concurrent waits cost the loop
  one query each and a share of one wake per drain of the waiter's completions (issue 50,
  item 4). Before a wait returns, every event has been `synchronize()`d by the thread that saw
  it complete (the loop's, or the waiter's), which tells tools such as TORCH_CUDA_SANITIZER
  that the host is ordered after the event.
- `finish` awaits the end of every stream the execution used, absorbing cancellation the way
  the scheduler waits for its threads, and only then returns the stream set: a frame is never
  reused while its GPU work is in flight. On trio, which cancels every later checkpoint of a
  cancelled scope, the rest of that wait is shielded.
- The per-execution fixed work is charged to the loop's LoopBudget (loop_charges.py's
  `LoopCharges`): `begin` takes the iteration's slice, and after `finish` the execution goes
  on only with room left in it, else in a later iteration, so executions whose GPU work ends
  together resume about a slice of work per iteration.

torch.cuda is imported lazily (only `TorchCudaBackend` touches it), so this module imports and
type-checks on machines without CUDA. The backend is injectable, which is how the tests drive
all of this logic on the CPU with fake streams and events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from asyncgraph.cuda.host_wait import HostWaiter, shared_waiter
from asyncgraph.cuda.loop_charges import LoopCharges
from asyncgraph.cuda.streams import StreamKey, StreamPlan
from asyncgraph.runtime.device import Calls, UnitSchedule
from asyncgraph.runtime.device import move_inputs_to_device as move_inputs_to_device
from asyncgraph.runtime.loop_budget import LoopBudget
from asyncgraph.runtime.plan import Placement

logger = logging.getLogger("asyncgraph.cuda.graphs")  # capture.py logs captures there too


class CudaStream(Protocol):
    """The part of torch.cuda.Stream this layer uses."""

    def wait_event(self, event: Any) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...


class CudaEvent(Protocol):
    """The part of torch.cuda.Event this layer uses."""

    def record(self, stream: Any) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaGraph(Protocol):
    """The part of torch.cuda.CUDAGraph captured executions use (asyncgraph/cuda/graphs.py)."""

    def replay(self) -> None:
        """Launch the captured work on the calling thread's current stream."""
        ...

    def reset(self) -> None:
        """Free the graph (and, once no graph uses it, its pool's memory)."""
        ...


class Backend(Protocol):
    """What the layer needs from CUDA; `TorchCudaBackend` is the real one.

    Switching streams is split in `stream_handle` (once per stream, when a stream set is
    made) and `enter_stream` / `leave_stream` (per unit of CUDA nodes), so the per-unit cost
    is what the backend's lowest level costs: for torch, one C call to read the current
    stream and, only when it differs, two to set it and set it back.
    """

    def new_stream(self, device: int) -> CudaStream: ...

    def new_capture_stream(self, device: int) -> CudaStream:
        """A stream for recording CUDA graphs that no stream set shares.

        A capture records every launch on its streams, from any thread, so nothing else may
        enqueue on them meanwhile. torch's pool hands out 32 streams per device and priority,
        round-robin, and the stream sets (8 frames x 4 streams by default) use up the
        default-priority ones; capture streams come from the high-priority pool, which stream
        sets never take from, and one capture runs at a time per process
        (`graphs.CAPTURE_LOCK`), so two captures never share one either.
        """
        ...

    def new_event(self) -> CudaEvent: ...

    def stream_handle(self, stream: Any) -> Any:
        """What `enter_stream` takes for `stream`: computed once per stream."""
        ...

    def enter_stream(self, handle: Any) -> Any:
        """Make the stream of `handle` the calling thread's current stream on its device;
        return the token `leave_stream` restores the previous state from."""
        ...

    def leave_stream(self, token: Any) -> None: ...

    def host_streams(self, device: int) -> list[Any]:
        """The streams the calling thread's GPU work may be on: current and default."""
        ...

    def record_stream(self, value: Any, stream: Any) -> None:
        """Mark every CUDA tensor in `value` as used on `stream`."""
        ...

    # CUDA graphs (asyncgraph/cuda/graphs.py)

    def new_graph(self) -> CudaGraph: ...

    def graph_pool(self) -> Any:
        """A private memory pool for one capture (`torch.cuda.graph_pool_handle()`)."""
        ...

    def capture(
        self, graph: CudaGraph, pool: Any, handle: Any
    ) -> contextlib.AbstractContextManager[None]:
        """While the block runs: the stream of `handle` is current and captured into `graph`
        (thread-local capture mode), its allocations come from `pool`. Work on other streams
        joins the capture by waiting on an event recorded on it inside the block, and must
        be joined back before the block ends. No event query, synchronize or host read of a
        GPU value may happen inside it."""
        ...


StreamId = tuple[int, int, int]
"""torch's identity of a stream: (stream_id, device_index, device_type), as
`torch._C._cuda_getCurrentStream` returns it and `torch._C._cuda_setStream` takes it."""


@dataclass(frozen=True, slots=True)
class CudaFunctions:
    """The torch.cuda entry points `TorchCudaBackend` calls: the C functions under
    torch.cuda's Python helpers, which those helpers reach only after `_lazy_init`, device
    index parsing and, for `torch.cuda.stream(...)`, `current_stream` twice (is_available,
    NVML and environment lookups per call). Their signatures are those of torch 1.10 to 2.13:
    `get_current(device) -> StreamId`, `set_stream(stream_id, device_index, device_type)`,
    which also makes the stream's device current."""

    get_current: Callable[[int], StreamId]
    get_default: Callable[[int], StreamId]
    set_stream: Callable[[int, int, int], None]
    get_device: Callable[[], int]
    set_device: Callable[[int], None]
    make_stream: Callable[..., Any]  # torch.cuda.Stream(device=...) or (stream_id=, ...)
    make_event: Callable[[], Any]

    @staticmethod
    def from_torch() -> CudaFunctions:
        import torch
        import torch.cuda

        if not torch.cuda.is_available():
            raise RuntimeError(
                "the program has CUDA nodes but torch.cuda.is_available() is False: "
                "export it on the CPU, or run it on a machine with a GPU"
            )
        c = torch._C
        return CudaFunctions(
            get_current=c._cuda_getCurrentStream,
            get_default=c._cuda_getDefaultStream,
            set_stream=c._cuda_setStream,
            get_device=c._cuda_getDevice,
            set_device=c._cuda_setDevice,
            make_stream=torch.cuda.Stream,
            make_event=torch.cuda.Event,  # no timing: cheaper to record
        )


_SAME = None
"""`enter_stream`'s token when the stream was current already: nothing to restore."""


class TorchCudaBackend:
    """The real backend: torch's CUDA C functions, looked up on first use (`CudaFunctions`).

    `stream_handle` is a stream's StreamId; `enter_stream` compares it with the thread's
    current stream on that device and sets it only when it differs; `leave_stream` sets the
    previous stream back and, when setting it moved the thread to another device, the
    previous device too (what `torch.cuda.stream(...)` restores, without its Python).
    Stream objects for the host's streams are made once per StreamId and kept.
    """

    def __init__(self, functions: CudaFunctions | None = None) -> None:
        self._functions = functions
        self._streams: dict[StreamId, Any] = {}

    @property
    def functions(self) -> CudaFunctions:
        if self._functions is None:
            self._functions = CudaFunctions.from_torch()
        return self._functions

    def new_stream(self, device: int) -> CudaStream:
        stream: CudaStream = self.functions.make_stream(device=device)
        return stream

    def new_capture_stream(self, device: int) -> CudaStream:
        stream: CudaStream = self.functions.make_stream(device=device, priority=-1)
        return stream

    def new_event(self) -> CudaEvent:
        event: CudaEvent = self.functions.make_event()
        return event

    def stream_handle(self, stream: Any) -> StreamId:
        return (int(stream.stream_id), int(stream.device_index), int(stream.device_type))

    def enter_stream(self, handle: StreamId) -> tuple[int, StreamId] | None:
        f = self.functions
        previous = f.get_current(handle[1])
        if previous == handle:
            return _SAME
        device = f.get_device()
        f.set_stream(*handle)
        return device, previous

    def leave_stream(self, token: tuple[int, StreamId] | None) -> None:
        if token is _SAME:
            return
        device, previous = token
        f = self.functions
        f.set_stream(*previous)  # makes previous's device current
        if device != previous[1]:
            f.set_device(device)

    def _stream(self, ident: StreamId) -> Any:
        stream = self._streams.get(ident)
        if stream is None:
            stream = self._streams[ident] = self.functions.make_stream(
                stream_id=ident[0], device_index=ident[1], device_type=ident[2]
            )
        return stream

    def host_streams(self, device: int) -> list[Any]:
        f = self.functions
        current, default = f.get_current(device), f.get_default(device)
        if current == default:
            return [self._stream(current)]
        return [self._stream(current), self._stream(default)]

    def record_stream(self, value: Any, stream: Any) -> None:
        for tensor in _cuda_tensors(value):
            tensor.record_stream(stream)

    def new_graph(self) -> CudaGraph:
        import torch.cuda

        graph: CudaGraph = torch.cuda.CUDAGraph()
        return graph

    def graph_pool(self) -> Any:
        import torch.cuda

        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: CudaGraph, pool: Any, handle: StreamId) -> Iterator[None]:
        """`CUDAGraph.capture_begin/capture_end` on the stream of `handle`, not
        `torch.cuda.graph(...)`, whose `__enter__` synchronizes the whole device (blocking
        the loop on every execution's GPU work) and empties the allocator's cache."""
        token = self.enter_stream(handle)
        try:
            graph.capture_begin(  # type: ignore[attr-defined]
                pool=pool, capture_error_mode="thread_local"
            )
            try:
                yield
            except BaseException:
                with contextlib.suppress(Exception):  # its error is the one raised
                    self._end_capture(graph, pool)
                raise
            self._end_capture(graph, pool)
        finally:
            self.leave_stream(token)

    def _end_capture(self, graph: CudaGraph, pool: Any) -> None:
        """`capture_end`, and when it fails, the pool given back to the allocator.

        `CUDAGraph::capture_end` checks `cudaStreamEndCapture` before it calls the caching
        allocator's `endAllocateToPool` (torch 2.11 to 2.13, and torch's main branch when this
        was written), and `reset()` releases only the pool of a capture that ended. So
        after one failed end the allocator stays in capture mode for the process:
        `empty_cache()` hits `INTERNAL ASSERT captures_underway.empty()` and blocks with a
        recorded stream are never freed. torch's own bindings (`_cuda_endAllocateToPool`,
        `_cuda_releasePool`, torch >= 2.8) end that and release the pool; the capture's
        error is then raised."""
        try:
            graph.capture_end()  # type: ignore[attr-defined]
        except BaseException:
            import torch

            device = torch.cuda.current_device()
            for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
                release = getattr(torch._C, name, None)
                if release is not None:
                    with contextlib.suppress(Exception):  # a pool already given back
                        release(device, pool)
            self._end_rng_capture()
            raise

    def _end_rng_capture(self) -> None:
        """One empty capture on the current (capture) stream, after a capture that failed.

        `capture_begin` puts the device's default CUDA generator in capture mode, and only
        the `capture_end` of a capture that succeeds takes it out (`capture_epilogue`, after
        `cudaStreamEndCapture`). After one failed end, every random op of the process raised
        "Offset increment outside graph capture encountered unexpectedly": `torch.randn` on
        the GPU, dropout, any later capture (seen on an H200 with torch 2.11: the GPU reports
        in benchmarks/results/gpu/). An
        empty capture that ends takes the generator out of capture mode; its pool is given
        back by `reset()`. Should that fail too, the capture's own error is still raised and
        this one is logged."""
        graph = self.new_graph()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the graph is empty
                graph.capture_begin(  # type: ignore[attr-defined]
                    capture_error_mode="thread_local"
                )
                graph.capture_end()  # type: ignore[attr-defined]
            graph.reset()
        except Exception:
            logger.warning(
                "after a failed CUDA graph capture, the empty capture that takes the CUDA "
                "generator out of capture mode failed too: random ops on this device may "
                "raise 'Offset increment outside graph capture'", exc_info=True,
            )


def _cuda_tensors(value: Any) -> Iterator[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _cuda_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _cuda_tensors(item)


# -- waiting on the host ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PollPolicy:
    """How the host waits for events (see `wait_events`).

    The loop polls `query()` between zero-timeout checkpoints (exact, and the loop runs its
    other tasks in between, but it burns the loop's CPU), then the waiter thread takes the
    wait over (no CPU on the loop; its wake costs a thread switch and the loop's wake from
    epoll, tens of us, more on a virtual machine whose idle CPU halted). How long it polls:

    - `spin_s`, when nothing is known of the wait, or when its site's waits last longer than
      `spin_max_s` (0: to the thread after one poll);
    - for a site (`WaitSite`: a host node's inputs, an execution's end) whose waits have
      lasted up to `spin_max_s`: 1.5 times what they last, at most `spin_max_s`, so that
      short GPU steps are caught exactly and long ones go to the thread early;
    - a wait of a site whose waits last longer goes to the thread after `spin_s`, and the
      loop polls again (zero-timeout checkpoints) from `spin_max_s` before the end they are
      expected to have, for at most 2 x `spin_max_s` (a loop timer starts it, up to 1 ms late
      on asyncio's selector loop and trio): the end is caught on the loop, without the
      thread's wake, at the cost of about `spin_max_s` of the loop's time per wait;
    - all of that only while no other wait is outstanding (`HostWaiter.outstanding`): with
      another one in flight the loop's time is every other request's, so a wait goes to the
      thread after its first query, a spinning one once another begins, and a handed one is
      not polled near its end. `max_delay_s` is then the longest interval of the waiter's
      poll thread between two polls of a wait queued behind another.

    `thread=False` (a backend whose events cannot be synchronized off the loop; also the wait
    of before issue 36, kept for comparison): no thread and no site; after `spin_s` the loop
    polls with sleeps of elapsed/8 capped at `max_delay_s`, which asyncio's selector loop and
    trio round up to 1 ms each (their timer granularity).
    """

    spin_s: float = 100e-6
    max_delay_s: float = 1e-3
    thread: bool = True
    spin_max_s: float = 1e-3


class WaitSite:
    """The measured length of the waits of one place (a host node's inputs, an execution's
    end): the median of the last `WINDOW` (an outlier, a first execution that loaded
    kernels, moves it only while it is among them), from which `wait_events` decides how
    long the loop polls before the waiter thread takes over. Loop thread only."""

    WINDOW = 9

    __slots__ = ("_recent", "expected_s", "waits")

    def __init__(self) -> None:
        self.expected_s: float | None = None
        self.waits = 0
        self._recent: deque[float] = deque(maxlen=self.WINDOW)

    def spin_s(self, policy: PollPolicy) -> float:
        expected = self.expected_s
        if expected is None or expected > policy.spin_max_s:
            return policy.spin_s
        return min(policy.spin_max_s, max(policy.spin_s, 1.5 * expected))

    def resume_s(self, policy: PollPolicy) -> float | None:
        """When, in seconds after a wait of this site began, the loop polls again a wait
        that went to the thread: `spin_max_s` before the expected end; None when the
        site's waits are short (polled throughout) or not measured yet."""
        expected = self.expected_s
        if expected is None or expected <= policy.spin_max_s:
            return None
        return expected - policy.spin_max_s

    def record(self, seconds: float) -> None:
        recent = self._recent
        recent.append(seconds)
        self.expected_s = sorted(recent)[len(recent) // 2]
        self.waits += 1

    def __repr__(self) -> str:
        expected = "?" if self.expected_s is None else f"{self.expected_s * 1e6:.0f} us"
        return f"<WaitSite {expected} over {self.waits} waits>"


async def wait_events(
    events: Sequence[CudaEvent], policy: PollPolicy = PollPolicy(),
    waiter: HostWaiter | None = None, site: WaitSite | None = None,
) -> None:
    """Await CUDA events from the event loop without ever blocking it (asyncio, uvloop, trio).

    Polls with zero-timeout checkpoints (for `policy.spin_s`, or what `site` has measured:
    see PollPolicy), then hands the events still pending to `waiter` (the process's shared one
    by default), whose thread blocks in their `synchronize()`; an error a `synchronize` or
    `query` raises is raised here. The loop spins only while no other wait is outstanding
    (`HostWaiter.outstanding`): with another one in flight, the spin would be loop time taken
    from every other request, so the wait hands off after its first query, and one spinning
    alone hands off once another begins. Cancellable at every checkpoint and while the thread
    waits (its entry is dropped). Every event is synchronized by the thread that saw it
    complete (the loop: it returns at once; or the waiter's), which records the host-side
    happens-before for the CUDA sanitizer. How long the GPU took goes to `site`.
    """
    pending = [e for e in events if not e.query()]
    handed: list[CudaEvent] = []
    if pending:
        start = time.perf_counter()
        if not policy.thread:
            completed = await _poll_sleeping(pending, policy, start)
            site = None
        else:
            waiter = waiter or shared_waiter()
            spin = policy.spin_s if site is None else site.spin_s(policy)
            pending, completed = await _spin(pending, spin, waiter, start)
            if pending:
                handed = pending
                resume = None if site is None else site.resume_s(policy)
                completed = await waiter.wait(
                    pending, policy.max_delay_s,
                    None if resume is None else start + resume, 2 * policy.spin_max_s,
                )
        if site is not None:
            site.record(completed - start)  # what the GPU took, not what waking took
    elif site is not None:
        site.record(0.0)
    for e in events:
        if not any(e is h for h in handed):
            e.synchronize()


async def _spin(
    pending: list[CudaEvent], spin_s: float, waiter: HostWaiter, start: float
) -> tuple[list[CudaEvent], float]:
    """Poll `pending` between zero-timeout checkpoints for `spin_s` from `start`, while no
    other wait is outstanding; the events still pending (for the waiter), and when the last
    poll ran (when the loop saw them all complete, if none is)."""
    if spin_s <= 0.0 or waiter.outstanding:
        return pending, start  # another wait is in flight (or no spin): hand off at once
    waiter.count_spinning(1)
    try:
        while True:
            await anyio.lowlevel.checkpoint()
            pending = [e for e in pending if not e.query()]
            now = time.perf_counter()
            if not pending or now - start >= spin_s or waiter.outstanding > 1:
                return pending, now
    finally:
        waiter.count_spinning(-1)


async def _poll_sleeping(pending: list[CudaEvent], policy: PollPolicy, start: float) -> float:
    """The wait of before issue 36 (`PollPolicy.thread=False`): poll for `spin_s`, then with
    sleeps of elapsed/8 capped at `max_delay_s`; when the loop saw the events complete."""
    while True:
        elapsed = time.perf_counter() - start
        await anyio.sleep(0.0 if elapsed < policy.spin_s else min(policy.max_delay_s, elapsed / 8))
        pending = [e for e in pending if not e.query()]
        if not pending:
            return time.perf_counter()


# -- stream sets ----------------------------------------------------------------------------------


class StreamSet:
    """One execution's streams: the stream of each (device, index) and of each CUDA node,
    and each CUDA node's stream handle (`Backend.stream_handle`, computed here once)."""

    __slots__ = ("by_node", "handles", "index", "items", "streams", "users")

    def __init__(
        self, index: int, streams: dict[StreamKey, CudaStream], plan: StreamPlan,
        backend: Backend,
    ) -> None:
        self.index = index
        self.streams = streams
        self.items = tuple(streams.items())  # what an execution using them all begins
        self.by_node: tuple[CudaStream | None, ...] = tuple(
            streams[(d, s)] if d is not None and s is not None else None
            for d, s in zip(plan.device, plan.stream, strict=True)
        )
        handles = {key: backend.stream_handle(stream) for key, stream in streams.items()}
        self.handles: tuple[Any, ...] = tuple(
            handles[(d, s)] if d is not None and s is not None else None
            for d, s in zip(plan.device, plan.stream, strict=True)
        )
        self.users = 0

    def __repr__(self) -> str:
        return f"<StreamSet {self.index} users={self.users}>"


class StreamPool:
    """The stream sets of one Executor (loop thread only).

    `acquire` prefers an idle set, creates one while fewer than `max_sets` exist, and otherwise
    shares the least-used set.
    """

    def __init__(self, plan: StreamPlan, max_sets: int, backend: Backend) -> None:
        if max_sets < 1:
            raise ValueError(f"max_sets must be >= 1, got {max_sets}")
        self.plan = plan
        self.max_sets = max_sets
        self.backend = backend
        self.sets: list[StreamSet] = []

    def acquire(self) -> StreamSet:
        idle = [s for s in self.sets if s.users == 0]
        if idle:
            chosen = idle[0]
        elif len(self.sets) < self.max_sets:
            streams = {key: self.backend.new_stream(key[0]) for key in self.plan.streams_used}
            chosen = StreamSet(len(self.sets), streams, self.plan, self.backend)
            self.sets.append(chosen)
        else:
            chosen = min(self.sets, key=lambda s: (s.users, s.index))
        chosen.users += 1
        return chosen

    def release(self, stream_set: StreamSet) -> None:
        if stream_set.users <= 0:
            raise RuntimeError(f"{stream_set!r} released more often than acquired")
        stream_set.users -= 1

    @property
    def in_use(self) -> int:
        return sum(1 for s in self.sets if s.users)


class CudaRuntime:
    """The GPU side of one Executor: its StreamPlan, stream pool and backend.

    `value_ids[i]` is the frame slot of node i's value (ExecutionPlan.outputs). `poll` and
    `waiter` are how its frames wait for GPU work on the host (`wait_events`; the waiter is
    the process's shared one unless given another); `close()` lets the waiter's thread end.
    """

    def __init__(
        self,
        plan: StreamPlan,
        value_ids: Sequence[int],
        *,
        max_stream_sets: int,
        backend: Backend | None = None,
        poll: PollPolicy = PollPolicy(),
        waiter: HostWaiter | None = None,
        loop_slice_s: float = math.inf,
    ) -> None:
        if len(value_ids) != plan.num_nodes:
            raise ValueError(f"{len(value_ids)} value ids for {plan.num_nodes} nodes")
        self.plan = plan
        self.value_ids = tuple(value_ids)
        self.backend: Backend = backend if backend is not None else TorchCudaBackend()
        self.pool = StreamPool(plan, max_stream_sets, self.backend)
        self.poll = poll
        self.waiter = waiter if waiter is not None else shared_waiter()
        # what each kind of wait has lasted (PollPolicy): a host node's inputs, the end of an
        # execution, its outputs
        self.host_sites: tuple[WaitSite | None, ...] = tuple(
            WaitSite() if w else None for w in plan.host_waits
        )
        self.finish_site = WaitSite()
        self.outputs_site = WaitSite()
        self.needs_host_wait: tuple[bool, ...] = tuple(bool(w) for w in plan.host_waits)
        # its executions' fixed work, charged to the loop's slice
        self.charges = LoopCharges(loop_slice_s)

    def close(self) -> None:
        """The Executor is closed (its frames idle): let the waiter thread end as soon as no
        wait is queued (HostWaiter.close). A later wait, of any runtime, starts it again."""
        self.waiter.close()

    def frame_state(self, calls: Sequence[Callable[[list[Any]], Any]]) -> FrameStreams:
        """GPU state for one ExecutionFrame; `calls` are the plan's node calls."""
        return FrameStreams(self, calls)


class SegmentCalls(Protocol):
    """A frame's captured segments (graphs.py's FrameSegments): the call of each one's unit."""

    def segment_call(self, index: int) -> Callable[[list[Any]], Any]: ...


class FrameStreams:
    """The GPU state of one frame, reused by its executions (one at a time): the frame's
    Device (asyncgraph/runtime/device.py).

    Per execution: `begin()`, then `calls[i](values)` for every node (CUDA nodes go through
    `run`), `wait_host(i)` before a host node that reads GPU values, `await finish()` before
    the frame is returned, and `protect_outputs(outputs)` for values handed to the caller.
    `unit_tables` gives the frame the calls and placements of a schedule's units; `segments`
    is the frame's captured segments (set by graphs.py), whose units call them.
    """

    __slots__ = (
        "_backend", "_begin_events", "_begun", "_budget", "_end_events", "_events", "_host",
        "_host_waits", "_outputs", "_set", "_tables", "_waits", "calls", "runtime", "segments",
        "weights_version",
    )

    def __init__(self, runtime: CudaRuntime, calls: Sequence[Callable[[list[Any]], Any]]) -> None:
        plan = runtime.plan
        backend = runtime.backend
        self.runtime = runtime
        self._backend = backend
        events = {i: backend.new_event() for i in range(plan.num_nodes) if plan.records_event[i]}
        self._events: tuple[CudaEvent | None, ...] = tuple(
            events.get(i) for i in range(plan.num_nodes)
        )
        self._waits = tuple(tuple(events[p] for p in ws) for ws in plan.waits)
        self._host_waits = tuple(tuple(events[p] for p in ws) for ws in plan.host_waits)
        self._outputs = tuple(events[p] for p in plan.output_waits)
        self._begin_events = {d: backend.new_event() for d in plan.devices}
        self._end_events = {key: backend.new_event() for key in plan.streams_used}
        self._set: StreamSet | None = None
        self._begun: tuple[tuple[StreamKey, CudaStream], ...] = ()  # what `finish` awaits
        self._budget: LoopBudget | None = None  # the loop's, that `begin` charged
        self._host: dict[int, tuple[Any, ...]] = {}  # per device: the caller's streams
        self.segments: SegmentCalls | None = None
        self.weights_version = 0  # the loaded execution's (ExecutionFrame.load): its segments'
        # id(schedule) -> (schedule, its unit calls, its unit placements): see unit_tables
        self._tables: dict[int, tuple[UnitSchedule, Calls, tuple[int, ...]]] = {}
        # CUDA nodes run through `run`; the scheduler calls `calls[i](values)` for every node,
        # so its hot loop needs no test for placement.
        self.calls: tuple[Callable[[list[Any]], Any], ...] = tuple(
            _bind_run(self, i, call) if d is not None else call
            for i, (call, d) in enumerate(zip(calls, plan.device, strict=True))
        )

    @property
    def stream_set(self) -> StreamSet | None:
        return self._set

    def unit_tables(self, schedule: UnitSchedule) -> tuple[Calls, tuple[int, ...]]:
        """The unit tables of `schedule` on this frame's GPU state, built on first use.

        A single CUDA node's unit calls the node's stream-enqueueing call (`run`); a CUDA
        run (consecutive CUDA nodes on one stream, schedule.py) calls its compiled code
        through `run_unit`, which switches to the run's stream once; a segment's unit calls
        the frame's captured segment (`segments`); a unit reading GPU values (never fused:
        ScheduleCache's `unfusable`) is marked Placement.HOST_WAIT. Keyed by the schedule's
        identity, as ScheduleCache keys placements: the schedules live as long as the
        Executor, and the entry keeps its schedule alive.
        """
        hit = self._tables.get(id(schedule))
        if hit is not None and hit[0] is schedule:
            return hit[1], hit[2]
        needs_wait = self.runtime.needs_host_wait
        calls = list(schedule.calls)
        where: list[int] = list(schedule.where)
        segments = schedule.segments
        for unit, nodes in enumerate(schedule.nodes):
            if segments and segments[unit] >= 0:  # a segment: warm-up, capture or replay
                captured = self.segments
                assert captured is not None, "a segment unit without segment state"
                calls[unit] = captured.segment_call(segments[unit])
            elif schedule.where[unit] is Placement.DEVICE:
                if len(nodes) == 1:
                    calls[unit] = self.calls[nodes[0]]
                else:
                    calls[unit] = self.unit_call(nodes[0], schedule.calls[unit])
            elif any(needs_wait[n] for n in nodes):
                if len(nodes) != 1:
                    raise RuntimeError(
                        f"unit {unit} fuses nodes {nodes} of which one waits for GPU values: "
                        "the schedule was built without `unfusable`"
                    )
                where[unit] = Placement.HOST_WAIT
        tables = (tuple(calls), tuple(where))
        self._tables[id(schedule)] = (schedule, *tables)
        return tables

    def begin(self, only: StreamKey | None = None) -> None:
        """Lease a stream set; order its streams after the caller's work (loop thread).

        The inputs and weights may have been written by kernels still queued on the caller's
        current (or default) stream; one event per device makes our streams wait for them.
        Those streams are also what a fenced CUDA node waits on (`run`): host kernels run on
        the loop thread, whose current stream is the caller's, or on worker threads, whose
        current stream is the default one; asking `host_streams` again from the thread that
        enqueues the CUDA node (a worker, possibly) could miss the caller's stream.

        `only`: the one stream this execution enqueues on (a replay of a whole capture uses
        the origin alone); the others are neither ordered nor awaited by `finish`, which
        saves an event record, wait and poll per idle stream.

        The execution's host work from here is charged to the loop's slice
        (`LoopCharges.open`).
        """
        if self._set is not None:
            raise RuntimeError("begin() called twice without finish()")
        runtime = self.runtime
        self._budget = runtime.charges.open()  # from here its host work takes the loop's slice
        stream_set = runtime.pool.acquire()
        begun = stream_set.items if only is None else ((only, stream_set.streams[only]),)
        try:
            host = {d: tuple(runtime.backend.host_streams(d)) for d in self._begin_events}
            for device, event in self._begin_events.items():
                for host_stream in host[device]:
                    event.record(host_stream)
                    for (d, _), stream in begun:
                        if d == device:
                            stream.wait_event(event)
        except BaseException:
            runtime.pool.release(stream_set)
            raise
        self._host = host
        self._begun = begun
        self._set = stream_set

    @contextlib.contextmanager
    def recording_on(self, capture_set: StreamSet) -> Iterator[None]:
        """While the block runs, CUDA nodes enqueue on `capture_set` (a capture's streams)
        instead of the leased set, which is put back after (graphs.py, whole captures)."""
        leased = self._set
        if leased is None:
            raise RuntimeError("recording_on() outside begin()/finish()")
        self._set = capture_set
        try:
            yield
        finally:
            self._set = leased

    def run(self, node: int, call: Callable[[list[Any]], Any], values: list[Any]) -> Any:
        """Enqueue one CUDA node on its stream; never waits on the host (any thread)."""
        stream_set = self._set
        if stream_set is None:
            raise RuntimeError("a CUDA node ran outside begin()/finish()")
        stream = stream_set.by_node[node]
        assert stream is not None
        for waited in self._waits[node]:
            stream.wait_event(waited)
        runtime = self.runtime
        plan = runtime.plan
        backend = runtime.backend
        if plan.fence[node]:
            self.fence(node, stream)
        token = backend.enter_stream(stream_set.handles[node])
        try:
            result = call(values)
        finally:
            backend.leave_stream(token)
        ids = runtime.value_ids
        for producer in plan.record_stream[node]:
            backend.record_stream(values[ids[producer]], stream)
        event = self._events[node]
        if event is not None:
            event.record(stream)
        return result

    def run_unit(
        self, node: int, unit: Callable[[list[Any], FrameStreams, Any], Any], values: list[Any]
    ) -> Any:
        """Enqueue a fused run of CUDA nodes on their one stream (`node`: its first node).

        The stream is switched once for the whole run (and only if it is not current);
        `unit` is the run's compiled code (asyncgraph/runtime/schedule.py), which calls
        `wait`, `fence`, `record_value` and `record_event` itself, only at the nodes the
        StreamPlan names: cross-stream edges, host values and events someone waits on.
        """
        stream_set = self._set
        if stream_set is None:
            raise RuntimeError("a CUDA node ran outside begin()/finish()")
        backend = self._backend
        token = backend.enter_stream(stream_set.handles[node])
        try:
            return unit(values, self, stream_set.by_node[node])
        finally:
            backend.leave_stream(token)

    def unit_call(
        self, node: int, unit: Callable[..., Any]
    ) -> Callable[[list[Any]], Any]:
        """The frame's call for a compiled CUDA run starting at `node` (see `run_unit`)."""
        run_unit = self.run_unit

        def run_fused(values: list[Any]) -> Any:
            return run_unit(node, unit, values)

        return run_fused

    # Called by compiled runs of CUDA nodes (schedule.py), on the run's stream.

    def wait(self, node: int, stream: Any) -> None:
        """Order `stream` after the events of `node`'s producers on other streams."""
        for waited in self._waits[node]:
            stream.wait_event(waited)

    def fence(self, node: int, stream: Any) -> None:
        """Order `stream` after the host streams `begin` saw (a HOST node's GPU tensors)."""
        device = self.runtime.plan.device[node]
        assert device is not None
        for host_stream in self._host[device]:
            stream.wait_stream(host_stream)

    def record_value(self, value: Any, stream: Any) -> None:
        """`record_stream(stream)` on the CUDA tensors of a value made on another stream."""
        self._backend.record_stream(value, stream)

    def record_event(self, node: int, stream: Any) -> None:
        event = self._events[node]
        assert event is not None
        event.record(stream)

    def host_ready(self, node: int) -> bool:
        """Whether every event host node `node` waits on has completed (never waits)."""
        events = self._host_waits[node]
        if not all(event.query() for event in events):
            return False
        for event in events:
            event.synchronize()  # completed: returns at once, and orders the host after it
        return True

    async def wait_host(self, node: int) -> None:
        """Await, without blocking the loop, the GPU values host node `node` reads."""
        runtime = self.runtime
        await wait_events(
            self._host_waits[node], runtime.poll, runtime.waiter, runtime.host_sites[node]
        )

    async def wait_outputs(self) -> None:
        """Await just the events that gate the graph's outputs (`StreamPlan.output_waits`).

        `finish` already covers them; this is for a caller that wants the outputs before the
        rest of the GPU work has drained.
        """
        runtime = self.runtime
        await wait_events(self._outputs, runtime.poll, runtime.waiter, runtime.outputs_site)

    async def finish(self, turn: bool = True) -> None:
        """Await the end of all GPU work of this execution, then return the stream set.

        Absorbs cancellation until the GPU is done (the frame must not be reused while
        kernels may still write its memory), then re-raises the first one it absorbed, once
        the stream set is back. The original exception, not a new CancelledError: anyio's
        cancel scopes on asyncio catch only their own (a fresh one escaped the caller's
        scope and cancelled its task group), and trio's Cancelled cannot be made at all. On
        trio, which cancels every later checkpoint of a cancelled scope, the rest of the wait
        is shielded. Then, the stream set back, the execution goes on only with room left in
        the loop's slice (`LoopCharges.turn`; not after an absorbed cancellation), unless
        `turn` is False: the caller gives back what it holds first (a graph instance others
        may wait for), then awaits `take_turn`. A no-op without `begin()`.
        """
        stream_set = self._set
        if stream_set is None:
            return
        absorbed: BaseException | None = None
        runtime = self.runtime
        try:
            ends = []
            for key, stream in self._begun:
                event = self._end_events[key]
                event.record(stream)
                ends.append(event)
            while True:
                try:
                    with _shielded_after(absorbed):
                        await wait_events(ends, runtime.poll, runtime.waiter, runtime.finish_site)
                    break
                except BaseException as exc:
                    if not _is_cancellation(exc):
                        raise
                    absorbed = exc
        finally:
            self._set = None
            self._begun = ()
            runtime.pool.release(stream_set)
        if absorbed is not None:
            raise absorbed
        if turn:
            await self.take_turn()

    async def take_turn(self) -> None:
        """Go on with the rest of the execution within the loop's slice (`LoopCharges.turn`),
        once after each `begin`; a no-op after that, or without `begin`."""
        budget, self._budget = self._budget, None
        if budget is not None:
            await self.runtime.charges.turn(budget)

    def protect_outputs(self, outputs: Sequence[Any]) -> None:
        """Record the caller's current stream on output tensors made on our streams.

        The caller will use them on its own stream; without this, once it drops them the
        allocator could give their memory to our stream while its kernels still read it.
        """
        backend = self._backend
        callers: dict[int, Any] = {}  # per device: the caller's current stream, asked once
        for value in outputs:
            for tensor in _cuda_tensors(value):
                index = tensor.device.index or 0
                caller = callers.get(index)
                if caller is None:
                    caller = callers[index] = backend.host_streams(index)[0]
                backend.record_stream(tensor, caller)


def _is_cancellation(exc: BaseException) -> bool:
    """Whether `exc` is the running backend's cancellation (asyncio's, or trio's Cancelled).
    Asked only once something was raised, so the wait itself costs no backend lookup."""
    return isinstance(exc, (asyncio.CancelledError, anyio.get_cancelled_exc_class()))


def _shielded_after(absorbed: BaseException | None) -> contextlib.AbstractContextManager[Any]:
    """The context of a wait that goes on after a cancellation was absorbed: trio would raise
    its Cancelled again at every checkpoint, so it is shielded there; asyncio delivers a
    cancellation once (a second `task.cancel()` is absorbed the same way)."""
    if absorbed is None or isinstance(absorbed, asyncio.CancelledError):
        return contextlib.nullcontext()
    return anyio.CancelScope(shield=True)


def _bind_run(
    frame: FrameStreams, node: int, call: Callable[[list[Any]], Any]
) -> Callable[[list[Any]], Any]:
    run = frame.run

    def run_on_stream(values: list[Any]) -> Any:
        return run(node, call, values)

    return run_on_stream


# -- inputs ---------------------------------------------------------------------------------------


# -- a reference driver -----------------------------------------------------------------------


async def run_in_order(gpu: FrameStreams, values: list[Any]) -> None:
    """Run every node of the plan in index order on the loop thread, with GPU ordering.

    A reference for tests and examples/gpu_check.py: the same calls the scheduler makes
    (begin, host waits, `calls[i]`, finish), without its parallelism or freeing. `values` is a
    loaded frame value list; results are stored in it.
    """
    runtime = gpu.runtime
    needs_wait = runtime.needs_host_wait
    ids = runtime.value_ids
    gpu.begin()
    try:
        for node, call in enumerate(gpu.calls):
            if needs_wait[node] and not gpu.host_ready(node):
                await gpu.wait_host(node)
            result = call(values)
            if asyncio.iscoroutine(result):
                result = await result
            values[ids[node]] = result
    finally:
        await gpu.finish()  # re-raises a cancellation it absorbed
