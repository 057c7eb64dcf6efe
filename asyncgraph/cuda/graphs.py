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

- The first `cuda.graph_warmup` executions of a signature on a frame take the normal stream
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
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import torch

from asyncgraph.cuda.capture import (
    CAPTURE_LOCK,
    CAPTURE_WAIT_S,
    Capture,
    CaptureState,
    CudaGraphs,
    FrameLease,
    clone_outputs,
    copy_inputs,
    empty_like,
    failure_text,
    lru_state,
)
from asyncgraph.cuda.device import FrameStreams, StreamSet
from asyncgraph.cuda.segment_graphs import FrameSegments
from asyncgraph.runtime.units import Line, in_order, run_units
from asyncgraph.runtime.validation import Signature, signature_of

if TYPE_CHECKING:
    from asyncgraph.runtime.frame import ExecutionFrame


def frame_captures(owner: CudaGraphs, gpu: FrameStreams) -> FrameGraphs | None:
    """A frame's whole-execution captures (Mode.CAPTURED replays them); None when its
    executions are not captured whole. A program that is not wholly capturable gets its
    segments' captures instead, which the frame's device state calls from its unit tables
    (inside the dataflow): the frame itself never sees them."""
    if owner.capture_plan.capturable:
        state = FrameGraphs(owner, gpu)
        owner.add_frame(state)
        return state
    if owner.segment_plan.segments:
        segments = FrameSegments(owner, gpu)
        gpu.segments = segments  # the GPU's unit tables call its segments
        owner.add_frame(segments)
    return None


class FrameGraphs:
    """The captures of one frame, by input signature (one execution at a time: the frame's).

    `run` is the Executor's one branch: it returns False when this execution takes the stream
    path (warming up, an uncapturable signature, a failed capture), and True once the frame's
    output slots hold this execution's outputs, the GPU work done.
    """

    __slots__ = (
        "__weakref__", "_capture_set", "_fork", "_gpu", "_joins", "_lease", "_owner",
        "_pool", "_states",
    )

    def __init__(self, owner: CudaGraphs, gpu: FrameStreams) -> None:
        self._owner = owner
        self._gpu = gpu
        self._states: OrderedDict[Signature, CaptureState] = OrderedDict()
        backend = owner.runtime.backend
        self._fork = backend.new_event()
        others = len(owner.runtime.plan.streams_used) - 1
        self._joins = [backend.new_event() for _ in range(others)]
        self._capture_set: StreamSet | None = None  # leased at the frame's first capture
        self._lease = FrameLease()
        # One memory pool for all the frame's captures: a frame replays one graph at a time
        # and clones its outputs right after, on the same stream, so a graph's intermediates
        # may reuse another's (memory: frames x the largest signature, not x signatures).
        self._pool: Any = None

    @property
    def live(self) -> int:
        """Graphs this frame holds."""
        return sum(1 for s in self._states.values() if s.capture is not None)

    async def run(
        self, frame: ExecutionFrame, flat: list[Any], signature: Signature | None, version: int
    ) -> bool:
        """Run the loaded frame as a capture or a replay when its signature is ready."""
        owner = self._owner
        key = signature if signature is not None else signature_of(flat)
        if key is None or key in owner.failed:
            owner.count("fallbacks")  # under its lock: captures count from threads
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
        self._lease.release()  # the frame's capture streams go back (CaptureStreamLeases)
        self._capture_set = None

    def _lease_capture_set(self) -> StreamSet | None:
        """The frame's capture streams, leased once for its life (CaptureStreamLeases); None
        while every capture stream is held by other frames (tried again after a release)."""
        if self._capture_set is not None:
            return self._capture_set
        runtime = self._owner.runtime
        streams = self._lease.get(runtime.backend, runtime.plan.streams_used)
        if streams is None:
            return None
        self._capture_set = StreamSet(-1, streams, runtime.plan, runtime.backend)
        return self._capture_set

    def _state(self, key: Signature) -> CaptureState:
        return lru_state(self._states, key, self._evicted)

    def _evicted(self) -> None:
        self._owner.evictions += 1

    # -- capture ------------------------------------------------------------------------------

    async def _capture(
        self, frame: ExecutionFrame, flat: list[Any], key: Signature, version: int
    ) -> Capture | None:
        """Capture this execution, replay it once for its result; None when capture raised
        (the frame is loaded again as it was, for the stream path).

        The capture runs on a worker thread (anyio's): warming the capture streams, recording
        every node and the first replay take milliseconds, which on the loop would stall every
        other request. The frame is this execution's alone meanwhile, and the capture is
        thread-local, so other threads go on enqueueing their work."""
        gpu = self._gpu
        gpu.begin(only=self._owner.capture_plan.origin)  # the rest runs on capture streams
        try:
            return await anyio.to_thread.run_sync(
                self._capture_here, frame.values, flat, key, version
            )
        finally:
            await gpu.finish()  # absorbs cancellation until the GPU is done, then re-raises

    def _capture_here(
        self, values: list[Any], flat: list[Any], key: Signature, version: int
    ) -> Capture | None:
        """`_capture`'s work, on the calling thread (the stream set is leased)."""
        owner = self._owner
        backend = owner.runtime.backend
        loaded = list(values)
        handle = self._origin_handle()
        token = backend.enter_stream(handle)
        try:  # static inputs: made and filled on the origin stream, outside the graph pool
            static = [empty_like(x) for x in flat]
            copy_inputs(static, flat)
        finally:
            backend.leave_stream(token)
        for slot, buffer, x in zip(owner.input_slots, static, flat, strict=True):
            values[slot] = buffer if buffer is not None else x
        capture_set = self._lease_capture_set()
        if capture_set is None:  # every capture stream is another frame's
            values[:] = loaded
            owner.count("fallbacks")
            return None
        if self._pool is None:
            self._pool = backend.graph_pool()
        graph, pool = backend.new_graph(), self._pool
        origin = capture_set.streams[owner.capture_plan.origin]  # type: ignore[index]
        # Another capture may be recording: off the loop, this thread waits its turn (a capture
        # takes milliseconds and waits on nothing), and gives up only past CAPTURE_WAIT_S.
        if not CAPTURE_LOCK.acquire(timeout=CAPTURE_WAIT_S):
            values[:] = loaded
            owner.count("fallbacks")
            return None
        try:  # recorded on the frame's capture streams: no other execution enqueues there
            self._warm(values, capture_set, origin)
            with self._gpu.recording_on(capture_set), backend.capture(
                graph, pool, backend.stream_handle(origin)
            ):
                self._record(values)
        except Exception as exc:
            values[:] = loaded
            with contextlib.suppress(Exception):  # an invalidated capture has little to free
                graph.reset()
            owner.mark_failed(key, failure_text(exc))
            return None
        finally:
            CAPTURE_LOCK.release()
        # The warm-up's kernels ran on the capture streams and read the static inputs; the
        # origin `finish` awaits (and the next replay's input copy) must come after them.
        self._leased_origin().wait_stream(origin)
        for slot, x in zip(owner.input_slots, flat, strict=True):
            values[slot] = x  # an input returned as an output is the caller's, not static
        outputs = {slot: values[slot] for slot in owner.capture_plan.produced_outputs}
        capture = Capture(graph, pool, static, outputs, version)
        owner.count("captures")
        token = backend.enter_stream(handle)
        try:
            graph.replay()
            self._clone_outputs(values, outputs)
        finally:
            backend.leave_stream(token)
        return capture

    def _warm(self, values: list[Any], capture_set: StreamSet, origin: Any) -> None:
        """Run the execution once on the capture streams, uncaptured, on this thread, before
        the capture: libraries allocate per (thread, stream) state on first use (cuBLAS's
        workspace, 32 MiB on Hopper), which would otherwise be allocated inside the capture,
        in the graph's pool. Ordered after the static inputs, made on the leased origin; the
        frame's values are put back as they were."""
        leased = self._leased_origin()
        ready = self._owner.runtime.backend.new_event()
        ready.record(leased)
        origin.wait_event(ready)
        before = list(values)
        with self._gpu.recording_on(capture_set):
            self._record(values)
        values[:] = before

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
        names = owner.graph.nodes

        def failed(run: Line, node: int, exc: BaseException) -> None:
            exc.add_note(
                f"while capturing node {names[node].name!r} ({names[node].target_name()})"
            )
            with contextlib.suppress(Exception):  # an invalidated capture refuses it
                self._join(origin, others)  # so that a valid capture can still end
            raise exc

        calls = self._gpu.calls
        line = Line(values, calls, owner.value_ids, owner.capture_plan.drops)
        guard = torch._C._InferenceMode(owner.inference_mode)
        try:
            run_units(line, in_order(len(calls)), failed)
        finally:
            del guard
        self._join(origin, others)

    def _join(self, origin: Any, others: list[Any]) -> None:
        """Join every forked stream back to the origin: a capture ends only with all joined."""
        for stream, event in zip(others, self._joins, strict=True):
            event.record(stream)
            origin.wait_event(event)

    # -- replay ---------------------------------------------------------------------------------

    async def _replay(self, frame: ExecutionFrame, flat: list[Any], capture: Capture) -> None:
        """Inputs into the static buffers, one replay, outputs cloned out, all on the origin
        stream after the caller's; then await the GPU (cancellation absorbed until done)."""
        backend = self._owner.runtime.backend
        gpu = self._gpu
        gpu.begin(only=self._owner.capture_plan.origin)  # a replay is one launch on one stream
        try:
            token = backend.enter_stream(self._origin_handle())
            try:
                copy_inputs(capture.static_inputs, flat)
                capture.graph.replay()
                self._clone_outputs(frame.values, capture.outputs)
            finally:
                backend.leave_stream(token)
        finally:
            await gpu.finish()

    def _clone_outputs(self, values: list[Any], outputs: dict[int, Any]) -> None:
        """`clone_outputs` under the Executor's inference mode, so a replay's outputs are
        inference tensors exactly when the stream path's are."""
        guard = torch._C._InferenceMode(self._owner.inference_mode)
        try:
            clone_outputs(values, outputs)
        finally:
            del guard

    def _leased_origin(self) -> Any:
        """The origin stream of the stream set this execution leased (`begin`)."""
        stream_set = self._gpu.stream_set
        assert stream_set is not None
        return stream_set.streams[self._owner.capture_plan.origin]  # type: ignore[index]

    def _origin_handle(self) -> Any:
        return self._owner.runtime.backend.stream_handle(self._leased_origin())


# -- segments (issue #15) -------------------------------------------------------------------------
