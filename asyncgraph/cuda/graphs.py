"""Captured executions: a whole execution of a GPU program replayed as one CUDA graph.

Why: an execution of a small GPU program is launch-bound: the host spends more time
enqueueing its kernels (tens of microseconds per node through Python) than the GPU spends
running them. A CUDA graph records the kernels of one execution once and replays them with a
single launch.

What is captured (decided once per Executor, `plan_capture`, pure and tested on the CPU): a
program whose every node is CUDA, ALIAS or META (asyncgraph/cuda/streams.py), whose CUDA nodes
are aten ops that neither sync the host nor have data-dependent shapes (capturable.py's
`DENIED`), on one device, and which mutates no user input and no buffer. Otherwise
`CapturePlan.reason` names the first node (or input, or setting) that prevents it. Such a
program's runs of capturable nodes between host nodes are captured as *segments* instead
(asyncgraph/cuda/segments.py, `FrameSegments` below).

How (`FrameGraphs`, one per frame, per input signature, at most `MAX_CAPTURES` kept, least
recently used evicted):

- The first `cuda_graph_warmup` executions of a signature on a frame take the normal stream
  path (lazy initialisation, cuBLAS workspaces on the frame's streams). The next one captures:
  static input buffers (made outside the graph's pool, the caller's inputs copied in), a
  private memory pool per capture, and an in-order run of the frame's node calls on its stream
  set between a fork (every other stream waits on an event recorded on the origin stream inside
  the capture) and a join (the origin waits on every other stream's event). Capture only
  records, so it is replayed once for that execution's result.
- Later executions of the signature: copy the inputs into the static buffers on the origin
  stream, replay, and *clone* the outputs out of the graph's static memory on the same stream.
  A replay writes the same static output tensors every time, so without the clone a caller
  holding an earlier output would see it overwritten by the frame's next replay; the clone
  costs one device copy per output and leaves ownership with the caller, as the stream path
  does. Non-tensor outputs (sizes from META nodes) are the capture's values, static per
  signature.
- Ordering and waiting are the stream path's: `FrameStreams.begin` orders the execution's
  streams after the caller's, `finish` awaits the end of every stream by polling events from
  the loop (never blocking it), absorbing cancellation until the GPU is done, and only then is
  the frame returned.
- Weights are captured by address: each capture remembers the Weights version it read, and an
  execution that loaded another version drops the frame's stale capture (the frame is leased
  and its earlier GPU work finished) and captures again at once (no second warm-up: the
  kernels are warm). A graph holding old weights is never replayed for newer ones.
- A capture that raises (an op that syncs the host, say) marks its signature uncapturable for
  the Executor: the reason is kept, logged once at WARNING, and that execution runs again on
  the stream path.

`torch.cuda.graph(...)` is not used: its `__enter__` calls `torch.cuda.synchronize()` (the
whole device: the loop thread would block on every other execution's GPU work) and empties the
allocator's cache. The backend calls `CUDAGraph.capture_begin/capture_end` on the origin
stream instead, with `capture_error_mode="thread_local"`: other threads keep enqueueing their
executions' work while one thread captures.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncgraph.cuda.capturable import node_blocker
from asyncgraph.cuda.device import CudaGraph, CudaRuntime, FrameStreams, StreamSet
from asyncgraph.cuda.segments import Segment, SegmentPlan, plan_segments
from asyncgraph.cuda.streams import Role, StreamKey, StreamPlan
from asyncgraph.graph.ir import Graph, OutputKind, TensorSpec, iter_refs
from asyncgraph.kernels import OpKernel
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.plan import ExecutionPlan
from asyncgraph.runtime.validation import Signature, _signature

if TYPE_CHECKING:
    from asyncgraph.runtime.frame import ExecutionFrame

logger = logging.getLogger(__name__)

MAX_CAPTURES = 8
"""Signatures one frame keeps state for (warm-up counts and captures); the least recently used
is evicted, its graph freed, when a ninth arrives."""

CAPTURE_LOCK = threading.Lock()
"""One capture at a time in the process: capture streams come from torch's high-priority pool
(32 per device, round-robin: `Backend.new_capture_stream`), which two captures at once could
share, each then recording the other's launches. Taken without blocking: an execution that
finds it held runs on the stream path and a later one captures."""

_MAX_FAILED = 256  # uncapturable signatures remembered per Executor

# -- the decision (pure) --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CapturePlan:
    """Whether an Executor's executions are captured, and what capture needs.

    Attributes:
        capturable: every execution may be captured (after warm-up, per input signature).
        reason: why not, naming the first offending node, input or setting; None when it is.
        origin: the (device, stream) the graph is captured and replayed on.
        drops: per node, the frame slots no later node reads (freed during the capture, so
            the graph's pool can reuse their memory).
        produced_outputs: the frame slots of user outputs made by nodes: cloned per replay.
    """

    capturable: bool
    reason: str | None
    origin: StreamKey | None = None
    drops: tuple[tuple[int, ...], ...] = ()
    produced_outputs: tuple[int, ...] = ()

    def describe(self) -> str:
        """One line for `asyncgraph profile` and logs."""
        if self.capturable:
            return "captured as CUDA graphs (per input signature, after warm-up)"
        return f"not captured: {self.reason}"


def plan_capture(
    graph: Graph,
    plan: ExecutionPlan,
    stream_plan: StreamPlan,
    kernels: Sequence[OpKernel],
    config: ExecutorConfig,
) -> CapturePlan:
    """The CapturePlan of an Executor's graph (the graph that runs: after folding)."""
    reason = _blocker(graph, stream_plan, kernels, config)
    if reason is not None:
        return CapturePlan(False, reason)
    return CapturePlan(
        True, None, stream_plan.streams_used[0], _drops(graph), _produced_outputs(graph)
    )


def segment_plan_for(
    capture_plan: CapturePlan,
    graph: Graph,
    stream_plan: StreamPlan,
    kernels: Sequence[OpKernel],
    config: ExecutorConfig,
) -> SegmentPlan:
    """The segments of a program that is not wholly capturable (asyncgraph/cuda/segments.py);
    none when it is: whole-execution capture stays its path."""
    if capture_plan.capturable:
        return SegmentPlan((), (), (), "the whole execution is captured")
    return plan_segments(graph, stream_plan, kernels, config)


def _blocker(
    graph: Graph, stream_plan: StreamPlan, kernels: Sequence[OpKernel], config: ExecutorConfig
) -> str | None:
    """The first reason the program cannot be captured, or None."""
    if not config.cuda_graphs:
        return "cuda_graphs=False"
    if config.trace:
        return "trace=True records a span per node, which a replay does not have"
    sig = graph.signature
    for out in sig.outputs:
        if out.kind is OutputKind.BUFFER_MUTATION:
            return f"the program mutates buffer {out.target!r}: a replay would not update it"
        if out.kind is OutputKind.USER_INPUT_MUTATION:
            return f"the program mutates input {out.target!r}: a replay writes its static copy"
    for spec in sig.user_inputs:
        vspec = graph.values[spec.value].spec
        if isinstance(vspec, TensorSpec) and vspec.device.type != "cuda":
            return (
                f"input {spec.target!r} is a {vspec.device.type} tensor: a graph would keep "
                "the value it had when captured"
            )
    for node, role, kernel in zip(graph.nodes, stream_plan.roles, kernels, strict=True):
        reason = node_blocker(graph, node.index, role, kernel, stream_plan)
        if reason is not None:
            return f"node {node.name!r} ({node.target_name()}) {reason}"
    devices = stream_plan.devices
    if len(devices) > 1:
        return f"CUDA nodes on devices {list(devices)}: one graph captures one device"
    return None


def _output_values(graph: Graph) -> set[int]:
    return {ref.id for out in graph.signature.outputs for ref in iter_refs(out.arg)}


def _drops(graph: Graph) -> tuple[tuple[int, ...], ...]:
    """Per node, the node-made values whose last reader it is (or that nobody reads), outputs
    excepted: dropped during the capture as the scheduler drops them."""
    outputs = _output_values(graph)
    last: dict[int, int] = {}
    for node in graph.nodes:
        last.setdefault(node.output, node.index)  # unread: dropped right after its node
        for v in node.inputs():
            last[v] = node.index
    drops: list[list[int]] = [[] for _ in graph.nodes]
    for value, reader in last.items():
        if graph.values[value].producer is not None and value not in outputs:
            drops[reader].append(value)
    return tuple(tuple(sorted(d)) for d in drops)


def _produced_outputs(graph: Graph) -> tuple[int, ...]:
    return tuple(
        sorted(v for v in _output_values(graph) if graph.values[v].producer is not None)
    )


# -- statistics ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CudaGraphStatistics:
    """What CUDA-graph capture did for one Executor.

    `warmups`: executions of a capturable program run on the stream path before their
    signature's capture (and those adaptive placement profiles); `fallbacks`: executions that
    could have been captured but ran on the stream path (a signature whose capture failed,
    inputs without a signature);
    `recaptures`: captures dropped because the weights changed; `failures`: captures that
    raised (`failed` lists the reasons, one per signature).

    Segments (programs that are not wholly captured, asyncgraph/cuda/segments.py):
    `segments` planned; `segment_captures`, `segment_replays`, `segment_warmups` (segment
    runs on the stream path before their signature's capture) and `segment_fallbacks`
    (segment runs on the stream path after a failed capture, or while another segment of
    the frame was capturing) count segment runs, not executions. `recaptures`, `evictions`,
    `failures`, `live_graphs` and `failed` count both kinds.
    """

    capturable: bool
    reason: str | None
    captures: int
    replays: int
    warmups: int
    fallbacks: int
    recaptures: int
    evictions: int
    failures: int
    live_graphs: int
    failed: tuple[str, ...]
    segments: int = 0
    segment_captures: int = 0
    segment_replays: int = 0
    segment_warmups: int = 0
    segment_fallbacks: int = 0


class CudaGraphs:
    """The CUDA-graph state an Executor shares across its frames: the plan, counters, the
    signatures whose capture failed, and the frames' states (to free them on close)."""

    def __init__(
        self, capture_plan: CapturePlan, runtime: CudaRuntime, graph: Graph, plan: ExecutionPlan,
        config: ExecutorConfig, segment_plan: SegmentPlan | None = None,
    ) -> None:
        self.capture_plan = capture_plan
        self.segment_plan = segment_plan if segment_plan is not None else SegmentPlan((), ())
        self.raw_calls = plan.calls  # node calls without the stream layer (for capture)
        self.segment_failed: dict[tuple[int, Any], str] = {}
        self._lock = threading.Lock()  # counters changed from worker threads (segments)
        self.runtime = runtime
        self.graph = graph
        self.value_ids = plan.outputs
        self.input_slots = plan.user_input_slots
        self.warmup = config.cuda_graph_warmup
        self.inference_mode = config.inference_mode
        self.failed: dict[Signature, str] = {}
        self.frames: weakref.WeakSet[FrameGraphs | FrameSegments] = weakref.WeakSet()
        self.captures = self.replays = self.warmups = self.fallbacks = 0
        self.segment_captures = self.segment_replays = 0
        self.segment_warmups = self.segment_fallbacks = 0
        self.recaptures = self.evictions = self.failures = 0

    def frame_state(self, gpu: FrameStreams) -> FrameGraphs | FrameSegments | None:
        """A frame's state: its whole-execution captures, or its segments' when the program
        is not wholly capturable; None when nothing is captured (its frames never look)."""
        state: FrameGraphs | FrameSegments
        if self.capture_plan.capturable:
            state = FrameGraphs(self, gpu)
        elif self.segment_plan.segments:
            state = FrameSegments(self, gpu)
            gpu.segments = state  # the GPU's unit tables call its segments
        else:
            return None
        self.frames.add(state)
        return state

    def mark_failed(self, key: Signature, reason: str) -> None:
        if len(self.failed) >= _MAX_FAILED:
            self.failed.clear()
        self.failed[key] = reason
        self.failures += 1
        logger.warning("CUDA graph capture failed; running uncaptured for %s: %s", key, reason)

    def count(self, counter: str) -> None:
        """Add one to `counter`: segment runs count from worker threads too (under a lock,
        since `+=` on an attribute is not atomic)."""
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def mark_segment_failed(self, index: int, key: Any, reason: str) -> None:
        """Segment `index` is not captured again for its input signature `key` (any thread)."""
        if len(self.segment_failed) >= _MAX_FAILED:
            self.segment_failed.clear()
        self.segment_failed[(index, key)] = reason
        self.count("failures")
        logger.warning(
            "CUDA graph capture of segment %d failed; running it uncaptured for %s: %s",
            index, key, reason,
        )

    def close(self) -> None:
        """Free every frame's graphs and pools (the Executor is closing; frames are idle)."""
        for state in list(self.frames):
            state.close()

    def statistics(self) -> CudaGraphStatistics:
        return CudaGraphStatistics(
            capturable=self.capture_plan.capturable,
            reason=self.capture_plan.reason,
            captures=self.captures,
            replays=self.replays,
            warmups=self.warmups,
            fallbacks=self.fallbacks,
            recaptures=self.recaptures,
            evictions=self.evictions,
            failures=self.failures,
            live_graphs=sum(s.live for s in list(self.frames)),
            failed=tuple(dict.fromkeys([*self.failed.values(), *self.segment_failed.values()])),
            segments=len(self.segment_plan.segments),
            segment_captures=self.segment_captures,
            segment_replays=self.segment_replays,
            segment_warmups=self.segment_warmups,
            segment_fallbacks=self.segment_fallbacks,
        )


# -- per frame ----------------------------------------------------------------------------------


class Capture:
    """One captured execution or segment: the graph, its pool, its static inputs and outputs,
    and the Weights version it read."""

    __slots__ = ("graph", "outputs", "pool", "static_inputs", "version")

    def __init__(
        self, graph: CudaGraph, pool: Any, static_inputs: list[Any], outputs: dict[int, Any],
        version: int,
    ) -> None:
        self.graph = graph
        self.pool = pool
        self.static_inputs = static_inputs  # per flat (or Segment) input: its buffer, or None
        self.outputs = outputs  # frame slot -> the static value a replay writes
        self.version = version  # the Weights version whose tensors it reads

    def free(self) -> None:
        self.graph.reset()
        self.static_inputs = []
        self.outputs = {}


class _CaptureState:
    """What a frame keeps per input signature (FrameGraphs) or per segment and key
    (FrameSegments): its warm-up count, then its capture."""

    __slots__ = ("capture", "runs")

    def __init__(self) -> None:
        self.runs = 0  # executions on the stream path so far (warm-up)
        self.capture: Capture | None = None


def _lru_state(
    states: OrderedDict[Any, _CaptureState], key: Any, evicted: Callable[[], None]
) -> _CaptureState:
    """The state of `key`, now the most recently used: a new one when there is none, which
    evicts the least recently used past MAX_CAPTURES (its capture freed, `evicted()` told)."""
    state = states.get(key)
    if state is not None:
        states.move_to_end(key)
        return state
    if len(states) >= MAX_CAPTURES:
        _, old = states.popitem(last=False)
        if old.capture is not None:
            old.capture.free()
            evicted()
    state = states[key] = _CaptureState()
    return state


class FrameGraphs:
    """The captures of one frame, by input signature (one execution at a time: the frame's).

    `run` is the Executor's one branch: it returns False when this execution takes the stream
    path (warming up, an uncapturable signature, a failed capture), and True once the frame's
    output slots hold this execution's outputs, the GPU work done.
    """

    __slots__ = ("__weakref__", "_capture_set", "_fork", "_gpu", "_joins", "_owner", "_states")

    def __init__(self, owner: CudaGraphs, gpu: FrameStreams) -> None:
        self._owner = owner
        self._gpu = gpu
        self._states: OrderedDict[Signature, _CaptureState] = OrderedDict()
        backend = owner.runtime.backend
        self._fork = backend.new_event()
        others = len(owner.runtime.plan.streams_used) - 1
        self._joins = [backend.new_event() for _ in range(others)]
        self._capture_set: StreamSet | None = None  # made at the frame's first capture

    @property
    def live(self) -> int:
        """Graphs this frame holds."""
        return sum(1 for s in self._states.values() if s.capture is not None)

    async def run(
        self, frame: ExecutionFrame, flat: list[Any], signature: Signature | None, version: int
    ) -> bool:
        """Run the loaded frame as a capture or a replay when its signature is ready."""
        owner = self._owner
        key = signature if signature is not None else _signature(flat)
        if key is None or key in owner.failed:
            owner.fallbacks += 1
            return False
        state = self._state(key)
        if frame.times is not None:  # profiled by adaptive placement: timed node by node
            state.runs += 1  # on this frame's streams, it warms up as well
            owner.warmups += 1
            return False
        capture = state.capture
        if capture is not None:
            if capture.version == version:
                owner.replays += 1  # launched, whatever happens while it is awaited
                await self._replay(frame, flat, capture)
                return True
            capture.free()  # weights changed: capture again at once (the kernels are warm)
            state.capture = None
            owner.recaptures += 1
        elif state.runs < owner.warmup:
            state.runs += 1
            owner.warmups += 1
            return False
        state.capture = await self._capture(frame, flat, key, version)
        return state.capture is not None

    def close(self) -> None:
        for state in self._states.values():
            if state.capture is not None:
                state.capture.free()
        self._states.clear()

    def _state(self, key: Signature) -> _CaptureState:
        return _lru_state(self._states, key, self._evicted)

    def _evicted(self) -> None:
        self._owner.evictions += 1

    # -- capture ------------------------------------------------------------------------------

    async def _capture(
        self, frame: ExecutionFrame, flat: list[Any], key: Signature, version: int
    ) -> Capture | None:
        """Capture this execution, replay it once for its result; None when capture raised
        (the frame is loaded again as it was, for the stream path)."""
        owner = self._owner
        backend = owner.runtime.backend
        gpu = self._gpu
        values = frame.values
        loaded = list(values)
        gpu.begin()
        try:
            handle = self._origin_handle()
            token = backend.enter_stream(handle)
            try:  # static inputs: made and filled on the origin stream, outside the graph pool
                static = [_empty_like(x) for x in flat]
                _copy_inputs(static, flat)
            finally:
                backend.leave_stream(token)
            for slot, buffer, x in zip(owner.input_slots, static, flat, strict=True):
                values[slot] = buffer if buffer is not None else x
            graph, pool = backend.new_graph(), backend.graph_pool()
            if self._capture_set is None:
                self._capture_set = owner.runtime.capture_set()
            capture_set = self._capture_set
            origin = capture_set.streams[owner.capture_plan.origin]  # type: ignore[index]
            if not CAPTURE_LOCK.acquire(blocking=False):  # another capture is recording
                values[:] = loaded
                owner.fallbacks += 1
                return None
            try:  # recorded on the frame's capture streams: no other execution enqueues there
                with gpu.recording_on(capture_set), backend.capture(
                    graph, pool, backend.stream_handle(origin)
                ):
                    self._record(values)
            except Exception as exc:
                values[:] = loaded
                with contextlib.suppress(Exception):  # an invalidated capture has little to free
                    graph.reset()
                owner.mark_failed(key, _failure(exc))
                return None
            finally:
                CAPTURE_LOCK.release()
            outputs = {slot: values[slot] for slot in owner.capture_plan.produced_outputs}
            capture = Capture(graph, pool, static, outputs, version)
            owner.captures += 1
            token = backend.enter_stream(handle)
            try:
                graph.replay()
                _clone_outputs(values, outputs)
            finally:
                backend.leave_stream(token)
            return capture
        finally:
            await gpu.finish()  # absorbs cancellation until the GPU is done, then re-raises

    def _record(self, values: list[Any]) -> None:
        """Every node in order, inside the capture: fork the stream set from the origin
        stream, run the frame's node calls (CUDA nodes enqueue on their planned streams, with
        their events), join every stream back. Never queries or waits on an event."""
        owner = self._owner
        stream_set = self._gpu.stream_set
        assert stream_set is not None
        origin_key = owner.capture_plan.origin
        origin = stream_set.streams[origin_key]  # type: ignore[index]
        others = [s for k, s in stream_set.streams.items() if k != origin_key]
        self._fork.record(origin)
        for stream in others:
            stream.wait_event(self._fork)
        ids, drops = owner.value_ids, owner.capture_plan.drops
        names = owner.graph.nodes
        guard = torch._C._InferenceMode(owner.inference_mode)
        try:
            for node, call in enumerate(self._gpu.calls):
                try:
                    values[ids[node]] = call(values)
                except Exception as exc:
                    exc.add_note(
                        f"while capturing node {names[node].name!r} ({names[node].target_name()})"
                    )
                    raise
                for value in drops[node]:
                    values[value] = None
        finally:
            del guard
        for stream, event in zip(others, self._joins, strict=True):
            event.record(stream)
            origin.wait_event(event)

    # -- replay ---------------------------------------------------------------------------------

    async def _replay(self, frame: ExecutionFrame, flat: list[Any], capture: Capture) -> None:
        """Inputs into the static buffers, one replay, outputs cloned out, all on the origin
        stream after the caller's; then await the GPU (cancellation absorbed until done)."""
        backend = self._owner.runtime.backend
        gpu = self._gpu
        gpu.begin()
        try:
            token = backend.enter_stream(self._origin_handle())
            try:
                _copy_inputs(capture.static_inputs, flat)
                capture.graph.replay()
                _clone_outputs(frame.values, capture.outputs)
            finally:
                backend.leave_stream(token)
        finally:
            await gpu.finish()

    def _origin_handle(self) -> Any:
        stream_set = self._gpu.stream_set
        assert stream_set is not None
        origin = stream_set.streams[self._owner.capture_plan.origin]  # type: ignore[index]
        return self._owner.runtime.backend.stream_handle(origin)


# -- segments (issue #15) -------------------------------------------------------------------------


class FrameSegments:
    """The segment captures of one frame (asyncgraph/cuda/segments.py), per segment and per
    signature of the segment's own inputs.

    A segment is one unit of the schedule; its call (`segment_call`) runs on the thread the
    scheduler runs CUDA units on, inside the execution (`FrameStreams.begin` has leased the
    stream set, `finish` awaits it), and never waits on the host:

    - warm-up (the first `cuda_graph_warmup` runs of a signature), an uncapturable signature
      or a capture already open on this frame: the segment's nodes on the stream path, in
      order (`FrameStreams.run`: planned streams, waits, events).
    - capture: the origin stream ordered after every stream of the set (and the host streams
      when a node is fenced), static buffers for the inputs made and filled there, then the
      nodes recorded on this frame's *private capture streams* (other units of the execution
      may be enqueueing on the set's streams from other threads meanwhile: they must not be
      captured), forked from and joined to the private origin, waiting inside only on events
      recorded inside. Then one replay for this execution's result, as below.
    - replay: the origin stream ordered after every stream of the set, inputs copied into the
      static buffers (the node-made inputs marked used on the origin stream: the frame may
      drop them once the unit ends), `replay()` on the set's origin stream, the outputs that
      leave the segment cloned into the frame's slots, then every other stream of the set
      ordered after the replay, the events nodes outside wait on recorded on the origin, and
      the clones marked used on every other stream (`record_stream`): a reader there may
      read them after the frame dropped them.

    `run` is the Executor's per-execution hook (as `FrameGraphs.run`): it keeps the weights
    version the execution loaded and returns False (the execution takes the dataflow).
    """

    __slots__ = (
        "__weakref__", "_after", "_gpu", "_handles", "_marks", "_owner",
        "_private", "_states", "version",
    )

    def __init__(self, owner: CudaGraphs, gpu: FrameStreams) -> None:
        self._owner = owner
        self._gpu = gpu
        backend = owner.runtime.backend
        self._states: list[OrderedDict[Any, _CaptureState]] = [
            OrderedDict() for _ in owner.segment_plan.segments
        ]
        self._marks = {key: backend.new_event() for key in owner.runtime.plan.streams_used}
        self._after = backend.new_event()
        self._private: dict[StreamKey, Any] = {}  # capture streams, made on first capture
        self._handles: dict[StreamKey, Any] = {}
        self.version = 0

    @property
    def live(self) -> int:
        return sum(1 for states in self._states for s in states.values() if s.capture)

    async def run(
        self, frame: ExecutionFrame, flat: list[Any], signature: Signature | None, version: int
    ) -> bool:
        """Keep the execution's weights version for its segments; it takes the dataflow."""
        self.version = version
        return False

    def segment_call(self, index: int) -> Callable[[list[Any]], None]:
        """The frame's call for the schedule unit of segment `index`."""
        run = self.run_segment

        def run_captured_segment(values: list[Any]) -> None:
            run(index, values)

        return run_captured_segment

    def close(self) -> None:
        for states in self._states:
            for state in states.values():
                if state.capture is not None:
                    state.capture.free()
            states.clear()

    def run_segment(self, index: int, values: list[Any]) -> None:
        """Run segment `index` of the loaded execution: on the stream path (warm-up, a failed
        or busy capture), as a capture, or as a replay (the class docstring)."""
        owner = self._owner
        seg = owner.segment_plan.segments[index]
        key = _segment_key(seg, values)
        if key is None or (index, key) in owner.segment_failed:
            owner.count("segment_fallbacks")
            self._stream_path(seg, values)
            return
        state = self._state(index, key)
        capture = state.capture
        if capture is not None:
            if capture.version == self.version:
                owner.count("segment_replays")
                self._launch(seg, capture, values)
                return
            capture.free()  # weights changed: capture again at once
            state.capture = None
            owner.count("recaptures")
        elif state.runs < owner.warmup:
            state.runs += 1
            owner.count("segment_warmups")
            self._stream_path(seg, values)
            return
        if not CAPTURE_LOCK.acquire(blocking=False):  # another capture is recording
            owner.count("segment_fallbacks")
            self._stream_path(seg, values)
            return
        try:
            state.capture = self._capture(index, seg, values, key)
        finally:
            CAPTURE_LOCK.release()
        if state.capture is None:
            self._stream_path(seg, values)

    def _state(self, index: int, key: Any) -> _CaptureState:
        return _lru_state(self._states[index], key, self._evicted)

    def _evicted(self) -> None:
        self._owner.count("evictions")  # segments run on worker threads: under the lock

    def _stream_path(self, seg: Segment, values: list[Any]) -> None:
        """The segment's nodes in order on their planned streams (the uncaptured path)."""
        ids = self._owner.value_ids
        calls = self._gpu.calls
        for position, node in enumerate(seg.nodes):
            try:
                values[ids[node]] = calls[node](values)
            except BaseException as exc:
                with contextlib.suppress(AttributeError):  # names the node: failed_node
                    exc.asyncgraph_node = node  # type: ignore[attr-defined]
                raise
            for value in seg.drops[position]:
                values[value] = None

    def _capture(
        self, index: int, seg: Segment, values: list[Any], key: Any
    ) -> Capture | None:
        """Capture segment `seg` and replay it once for this execution; None when capture
        raised (the signature is then marked uncapturable, the reason logged once)."""
        owner = self._owner
        backend = owner.runtime.backend
        stream_set = self._gpu.stream_set
        assert stream_set is not None
        origin = stream_set.streams[seg.origin]
        self._order_before(seg, origin)
        token = backend.enter_stream(backend.stream_handle(origin))
        try:  # static inputs: made and filled on the origin stream, outside the graph pool
            weights = set(seg.weights)
            static = [
                None if v in weights else _empty_like(values[v]) for v in seg.inputs
            ]
            _copy_inputs(static, [values[v] for v in seg.inputs])
        finally:
            backend.leave_stream(token)
        private = list(values)  # the frame's slots stay as they are for the other units
        for slot, buffer in zip(seg.inputs, static, strict=True):
            if buffer is not None:
                private[slot] = buffer
        graph, pool = backend.new_graph(), backend.graph_pool()
        streams = self._capture_streams(seg)
        try:
            with backend.capture(graph, pool, self._handles[seg.origin]):
                self._record(seg, private, streams)
        except Exception as exc:
            with contextlib.suppress(Exception):
                graph.reset()
            owner.mark_segment_failed(index, key, _failure(exc))
            return None
        outputs = {slot: private[slot] for slot in seg.outputs}
        capture = Capture(graph, pool, static, outputs, self.version)
        owner.count("segment_captures")
        self._launch(seg, capture, values)
        return capture

    def _capture_streams(self, seg: Segment) -> dict[StreamKey, Any]:
        backend = self._owner.runtime.backend
        for key in seg.streams:
            if key not in self._private:
                stream = self._private[key] = backend.new_capture_stream(key[0])
                self._handles[key] = backend.stream_handle(stream)
        return self._private

    def _record(self, seg: Segment, values: list[Any], streams: dict[StreamKey, Any]) -> None:
        """The segment's nodes inside the capture, on the private streams: fork, nodes with
        waits only on events recorded inside, join. Never queries or waits on an event."""
        owner = self._owner
        backend = owner.runtime.backend
        plan = owner.runtime.plan
        raw = owner.raw_calls
        ids = owner.value_ids
        origin = streams[seg.origin]
        others = [streams[k] for k in seg.streams[1:]]
        fork = backend.new_event()
        fork.record(origin)
        for stream in others:
            stream.wait_event(fork)
        waited = {s for sources in seg.sources for s in sources}
        inner: dict[int, Any] = {}
        names = owner.graph.nodes
        for position, node in enumerate(seg.nodes):
            try:
                if plan.roles[node] is Role.CUDA:
                    key = plan.key(node)
                    stream = streams[key]
                    for source in seg.sources[position]:
                        stream.wait_event(inner[source])
                    token = backend.enter_stream(self._handles[key])
                    try:
                        result = raw[node](values)
                    finally:
                        backend.leave_stream(token)
                    if node in waited:
                        event = inner[node] = backend.new_event()
                        event.record(stream)
                else:
                    result = raw[node](values)  # ALIAS / META: on the host, no GPU data
            except Exception as exc:
                exc.add_note(
                    f"while capturing node {names[node].name!r} ({names[node].target_name()})"
                )
                raise
            values[ids[node]] = result
            for value in seg.drops[position]:
                values[value] = None
        for stream in others:
            join = backend.new_event()
            join.record(stream)
            origin.wait_event(join)

    def _order_before(self, seg: Segment, origin: Any) -> None:
        """The origin stream after everything enqueued on the set's other streams (the
        segment's producers there), and after the host streams when a node is fenced."""
        stream_set = self._gpu.stream_set
        assert stream_set is not None
        for key, stream in stream_set.streams.items():
            if key != seg.origin:
                mark = self._marks[key]
                mark.record(stream)
                origin.wait_event(mark)
        plan = self._owner.runtime.plan
        fenced = [n for n in seg.nodes if plan.fence[n]]
        if fenced:
            self._gpu.fence(fenced[0], origin)

    def _launch(self, seg: Segment, capture: Capture, values: list[Any]) -> None:
        """Inputs in, replay, outputs cloned out on the set's origin stream; then the rest of
        the set and the host ordered after it (the class docstring)."""
        backend = self._owner.runtime.backend
        gpu = self._gpu
        stream_set = gpu.stream_set
        assert stream_set is not None
        origin = stream_set.streams[seg.origin]
        self._order_before(seg, origin)
        token = backend.enter_stream(backend.stream_handle(origin))
        try:
            _copy_inputs(capture.static_inputs, [values[v] for v in seg.inputs])
            for slot in seg.made_inputs:  # node-made: freed after this unit, read on origin
                backend.record_stream(values[slot], origin)
            capture.graph.replay()
            _clone_outputs(values, capture.outputs)
        finally:
            backend.leave_stream(token)
        after = self._after
        after.record(origin)
        for key, stream in stream_set.streams.items():
            if key != seg.origin:
                stream.wait_event(after)
                for slot in seg.outputs:
                    backend.record_stream(values[slot], stream)
        for node in seg.events:
            gpu.record_event(node, origin)


def _segment_key(seg: Segment, values: list[Any]) -> Any:
    """The signature of a segment's inputs: shape, stride, dtype and device of each tensor,
    the value of each other input (sizes from META nodes); None when one is unhashable."""
    parts: list[Any] = []
    for v in seg.inputs:
        x = values[v]
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.stride(), x.dtype, x.device))
            continue
        try:
            hash(x)
        except TypeError:
            return None
        parts.append((type(x), x))
    return tuple(parts)


def _empty_like(x: Any) -> Any:
    return torch.empty_like(x) if isinstance(x, torch.Tensor) else None


def _copy_inputs(static: list[Any], flat: list[Any]) -> None:
    """The caller's tensors into the static buffers (on the current stream), without autograd:
    a copy from a tensor that requires grad must not make the buffer part of a graph."""
    with torch.no_grad():
        for buffer, x in zip(static, flat, strict=True):
            if buffer is not None:
                buffer.copy_(x)


def _clone_outputs(values: list[Any], outputs: dict[int, Any]) -> None:
    """The frame's output slots get copies of the graph's static outputs (on the current
    stream): the caller owns them, and the frame's next replay cannot overwrite them."""
    for slot, value in outputs.items():
        values[slot] = _clone(value)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


def _failure(exc: BaseException) -> str:
    notes = "; ".join(getattr(exc, "__notes__", ()))
    text = f"{type(exc).__name__}: {exc}"
    return f"{text} ({notes})" if notes else text
