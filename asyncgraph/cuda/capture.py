"""What every CUDA-graph capture shares: the Executor's capture state and counters, one lock,
the captures themselves, and copying inputs in and cloning outputs out.

graphs.py (whole executions, `FrameGraphs`) and segment_graphs.py (segments, `FrameSegments`)
are the frame-side users; this module is what they have in common, so that the capture
bookkeeping (failed signatures, statistics) is written once. Whole executions are captured
into graph instances that the Executor keeps per input signature, apart from its frames
(instances.py: capture streams are leased per instance, so 64 frames share the 8 instances
that torch's 32 capture streams allow a plan on 4 streams); segments keep their captures per
frame (an LRU of `MAX_CAPTURES` per frame, `lru_state`, and a capture-stream lease per frame).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asyncgraph.cuda.capturable import CapturePlan
from asyncgraph.cuda.device import CudaGraph, CudaRuntime
from asyncgraph.cuda.instances import CAPTURE_STREAMS as CAPTURE_STREAMS
from asyncgraph.cuda.instances import CaptureStreamLeases as CaptureStreamLeases
from asyncgraph.cuda.instances import FrameLease as FrameLease
from asyncgraph.cuda.instances import GraphInstances, SignatureInstances
from asyncgraph.cuda.segments import SegmentPlan
from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.batching import default_buckets
from asyncgraph.runtime.bucket_inputs import BucketRows
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.plan import ExecutionPlan
from asyncgraph.runtime.validation import Signature

logger = logging.getLogger("asyncgraph.cuda.graphs")  # one logger for captures of both kinds

MAX_CAPTURES = 8
"""Signatures kept with captures: per Executor for whole executions (their warm-up counts and
graph instances, instances.py), per frame for segments; the least recently used is evicted,
its graphs freed, when a ninth arrives."""

CAPTURE_LOCK = threading.Lock()
"""One capture at a time in the process: capture streams come from torch's high-priority pool
(32 per device, round-robin: `Backend.new_capture_stream`), which two captures at once could
share, each then recording the other's launches. Taken without blocking: an execution that
finds it held runs on the stream path and a later one captures."""

CAPTURE_WAIT_S = 1.0
"""How long a whole-execution capture, on its worker thread, waits for another to finish
recording before it runs the execution uncaptured (segments, captured inside an execution,
never wait)."""

_MAX_FAILED = 256  # uncapturable signatures remembered per Executor


def captured_signatures(config: ExecutorConfig) -> int:
    """The signatures whose whole-execution graphs an Executor keeps: CudaConfig's
    max_captured_signatures, or by default MAX_CAPTURES, or with batching into buckets two
    batch keys' worth of buckets (CudaConfig's docstring says why)."""
    chosen = config.cuda.max_captured_signatures
    if chosen is not None:
        return chosen
    batching = config.batching
    if batching is None:
        return MAX_CAPTURES
    buckets = (batching.buckets if batching.buckets is not None
               else default_buckets(batching.max_batch_size))
    return max(MAX_CAPTURES, 2 * len(buckets))


class FrameCaptures(Protocol):
    """A frame's capture state (segment_graphs.py's FrameSegments), as the owner sees it."""

    @property
    def live(self) -> int: ...
    def close(self) -> None: ...


class AheadCaptures(Protocol):
    """The Executor's captures ahead (graphs.py's CaptureAhead), as the owner sees them."""

    closed: bool

    async def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CudaGraphStatistics:
    """What CUDA-graph capture did for one Executor.

    `warmups`: executions of a capturable program run on the stream path before their
    signature's capture (and those adaptive placement profiles); `fallbacks`: executions that
    could have been captured but ran on the stream path (a signature whose capture failed,
    inputs without a signature);
    `recaptures`: captures dropped because the weights changed; `failures`: captures that
    raised (`failed` lists the reasons, one per signature).

    Graph instances (whole executions, asyncgraph/cuda/instances.py): `instances` holding a
    captured graph now; `instance_waits`: executions that waited for another execution to
    give an instance of their signature back; `lease_failures`: capture-stream leases for a
    new instance that found none free (each remembered until some holder releases streams).

    Captures ahead (graphs.py's CaptureAhead: `Executor.warm_up`, `CudaConfig.capture_ahead`):
    `captured_ahead` of the `captures` were made on the capture-ahead thread, off every
    execution (`captures - captured_ahead` were paid for by an execution); `before_ready`:
    executions that ran on the stream path because their signature's capture ahead was not
    done yet (they never wait for one); `signatures`: per signature kept, and per signature
    whose capture failed, its `SignatureCapture` (pending, capturing, ready, failed, with why).

    The loop's slice (cuda/loop_charges.py): `loop_turns_deferred` counts the times
    an execution found the loop's slice spent and waited for a later iteration, to start
    or to go on after its GPU work (every execution of the Executor, captured or not).

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
    instances: int = 0
    instance_waits: int = 0
    lease_failures: int = 0
    captured_ahead: int = 0
    before_ready: int = 0
    signatures: tuple[SignatureCapture, ...] = ()
    loop_turns_deferred: int = 0


PENDING, CAPTURING, READY, FAILED, UNCAPTURED = (
    "pending", "capturing", "ready", "failed", "uncaptured")


@dataclass(frozen=True, slots=True)
class SignatureCapture:
    """Where one input signature's whole-execution graphs stand (`CudaGraphStatistics
    .signatures`): `state` is READY once one of its instances holds a graph (`instances`
    of them do), else CAPTURING while a capture ahead records it on the thread, PENDING
    while one is queued, FAILED once a capture raised (`reason`: the error; it runs on the
    stream path from then on), else UNCAPTURED (`reason`: warming up on the stream path, or
    why its last capture ahead captured nothing, such as no free capture stream)."""

    signature: str  # its inputs, e.g. "(float32[8, 4] cuda:0, 3)"
    state: str
    instances: int = 0
    reason: str | None = None


def describe_signature(key: Signature) -> str:
    """An input signature (validation's `Signature`) as one line: tensors as dtype[shape]
    and device, plain scalars as their value."""
    parts = []
    for part in key:
        if len(part) == 4 and isinstance(part[2], torch.dtype):
            _, shape, dtype, device = part
            dims = ", ".join(str(d) for d in shape)
            parts.append(f"{str(dtype).removeprefix('torch.')}[{dims}] {device}")
        else:
            parts.append(repr(part[-1]))
    return f"({', '.join(parts)})"


class CudaGraphs:
    """The CUDA-graph state an Executor shares across its frames: the plan, counters, the
    signatures whose capture failed, the graph instances of whole executions (`instances`)
    and the frames' segment states (to free them on close)."""

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
        self.warmup = config.cuda.graph_warmup
        self.inference_mode = config.inference_mode
        self.failed: dict[Signature, str] = {}
        self.frames: weakref.WeakSet[FrameCaptures] = weakref.WeakSet()
        self.captures = self.replays = self.warmups = self.fallbacks = 0
        self.segment_captures = self.segment_replays = 0
        self.segment_warmups = self.segment_fallbacks = 0
        self.recaptures = self.evictions = self.failures = 0
        self.instances = GraphInstances(runtime, config.max_concurrent_executions,
                                        captured_signatures(config))
        # captures ahead (graphs.py's CaptureAhead): on the first request of a signature too,
        # or only those Executor.warm_up asks for
        self.capture_ahead = config.cuda.capture_ahead
        self.captured_ahead = self.before_ready = 0
        self.ahead: AheadCaptures | None = None  # made on first use (graphs.capture_ahead)

    def add_frame(self, state: FrameCaptures) -> None:
        """Keep a frame's capture state, to count its graphs and free them on close."""
        self.frames.add(state)

    def mark_failed(self, key: Signature, reason: str) -> None:
        """`key` is not captured again (any thread: captures run on worker threads)."""
        with self._lock:
            if len(self.failed) >= _MAX_FAILED:
                self.failed.clear()
            self.failed[key] = reason
        self.count("failures")
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

    async def stop(self) -> None:
        """Stop the captures ahead and wait for the running one (the Executor is closing:
        before `close`, which frees what they captured)."""
        if self.ahead is not None:
            await self.ahead.stop()

    def close(self) -> None:
        """Free every instance and every frame's segment graphs and pools, and release their
        capture streams (the Executor is closing; frames, so instances, are idle)."""
        self.instances.close()
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
            evictions=self.evictions + self.instances.evictions,
            failures=self.failures,
            live_graphs=self.instances.live + sum(s.live for s in list(self.frames)),
            failed=tuple(dict.fromkeys([*self.failed.values(), *self.segment_failed.values()])),
            segments=len(self.segment_plan.segments),
            segment_captures=self.segment_captures,
            segment_replays=self.segment_replays,
            segment_warmups=self.segment_warmups,
            segment_fallbacks=self.segment_fallbacks,
            instances=self.instances.live,
            instance_waits=self.instances.waits,
            lease_failures=self.instances.lease_failures,
            captured_ahead=self.captured_ahead,
            before_ready=self.before_ready,
            signatures=self.signature_captures(),
            loop_turns_deferred=self.runtime.charges.deferred,
        )

    def signature_captures(self) -> tuple[SignatureCapture, ...]:
        """Each signature kept (least recently used first), then each whose capture failed."""
        kept = [self._capture_of(state) for state in self.instances.signatures()]
        failed = [SignatureCapture(describe_signature(key), FAILED, 0, reason)
                  for key, reason in list(self.failed.items())]
        return (*kept, *failed)

    def signature_capture(self, key: Signature) -> SignatureCapture:
        """Where `key`'s graphs stand now (see SignatureCapture)."""
        reason = self.failed.get(key)
        if reason is not None:
            return SignatureCapture(describe_signature(key), FAILED, 0, reason)
        state = self.instances.find(key)
        if state is None:
            closed = self.ahead is not None and self.ahead.closed
            return SignatureCapture(
                describe_signature(key), UNCAPTURED, 0,
                "the executor closed" if closed
                else "not kept: evicted by other signatures (CudaConfig."
                     f"max_captured_signatures={self.instances.max_signatures})",
            )
        return self._capture_of(state)

    def _capture_of(self, state: SignatureInstances) -> SignatureCapture:
        text = describe_signature(state.key)
        ready = self.instances.captured(state)
        if ready:
            return SignatureCapture(text, READY, ready)
        if state.capturing:
            return SignatureCapture(text, CAPTURING)
        if state.jobs:
            return SignatureCapture(text, PENDING)
        reason = state.reason
        if reason is None and state.runs < self.warmup:
            reason = f"warming up on the stream path ({state.runs} of {self.warmup} executions)"
        return SignatureCapture(text, UNCAPTURED, 0, reason)


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


class CaptureState:
    """What a frame keeps per input signature (FrameGraphs) or per segment and key
    (FrameSegments): its warm-up count, then its capture."""

    __slots__ = ("capture", "runs")

    def __init__(self) -> None:
        self.runs = 0  # executions on the stream path so far (warm-up)
        self.capture: Capture | None = None


def lru_state(
    states: OrderedDict[Any, CaptureState], key: Any, evicted: Callable[[], None]
) -> CaptureState:
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
    state = states[key] = CaptureState()
    return state


def empty_like(x: Any) -> Any:
    return torch.empty_like(x) if isinstance(x, torch.Tensor) else None


def copy_inputs(static: list[Any], flat: list[Any]) -> None:
    """The caller's tensors into the static buffers (on the current stream), without autograd:
    a copy from a tensor that requires grad must not make the buffer part of a graph. Only
    then is autograd turned off: entering and leaving `torch.no_grad()` costs about as much
    as a small copy itself, on every replay, and a copy between tensors that do not require
    grad records nothing anyway. A bucket batch whose rows are not copied yet (BucketRows)
    copies them straight from its requests into the static buffers."""
    if type(flat) is BucketRows and not flat.materialised:
        flat.fill(static)
    elif any(isinstance(x, torch.Tensor) and x.requires_grad for x in flat):
        with torch.no_grad():
            _copy_inputs(static, flat)
    else:
        _copy_inputs(static, flat)


def _copy_inputs(static: list[Any], flat: list[Any]) -> None:
    for buffer, x in zip(static, flat, strict=True):
        if buffer is not None:
            buffer.copy_(x)


def clone_outputs(values: list[Any], outputs: dict[int, Any]) -> None:
    """The frame's output slots get copies of the graph's static outputs (on the current
    stream): the caller owns them, and the frame's next replay cannot overwrite them."""
    for slot, value in outputs.items():
        values[slot] = clone(value)


def clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(clone(v) for v in value)
    return value


def failure_text(exc: BaseException) -> str:
    notes = "; ".join(getattr(exc, "__notes__", ()))
    text = f"{type(exc).__name__}: {exc}"
    return f"{text} ({notes})" if notes else text
