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

How: the graphs are *instances* the Executor keeps per input signature, apart from its frames
(asyncgraph/cuda/instances.py: why, the lease, the bounds). Capture streams are leased per
instance, so the frames share the instances that torch's 32 capture streams per device allow
(8 for a plan on 4 streams), where each frame used to lease its own and most could never
capture. An execution in Mode.CAPTURED (`FrameGraphs.run`, the frame's entry point) leases an
instance of its signature as it leases a frame, runs it on the frame's streams, and gives it
back once its GPU work is done:

- The first `cuda.graph_warmup` executions of a signature (per Executor) take the normal stream
  path (lazy initialisation, cuBLAS workspaces). Then an execution that finds no idle
  instance and room for one more leases its capture streams and captures it on a worker
  thread: static input buffers (made outside the graph's pool, the caller's inputs copied
  in), the instance's private memory pool, one uncaptured run on the capture streams (their
  libraries' per-stream state allocated outside the pool), then an in-order run of the node
  calls on the capture streams between a fork (every other stream waits on an event recorded
  on the origin stream inside the capture) and a join (the origin waits on every other
  stream's event). Capture only records, so it is replayed once for that execution's result.
  A new instance after warm-up needs no second warm-up.
- Executions that find every instance of their signature busy and no room for another wait
  for one, first come first served; with no instance at all and none to be had they take the
  stream path at once (no thread hop, nothing allocated: a failed capture-stream lease is
  remembered until some holder releases streams).
- A replay: copy the inputs into the instance's static buffers on the frame's origin stream,
  replay, and *clone* the outputs out of the graph's static memory on the same stream. A
  replay writes the same static output tensors every time, so without the clone a caller
  holding an earlier output would see it overwritten by the instance's next replay; the clone
  costs one device copy per output and leaves ownership with the caller, as the stream path
  does. Non-tensor outputs (sizes from META nodes) are the capture's values, static per
  signature.
- Ordering and waiting are the stream path's: `FrameStreams.begin` orders the execution's
  origin stream after the caller's, `finish` awaits its end by polling events from the loop
  (never blocking it), absorbing cancellation until the GPU is done, and only then are the
  instance and the frame given back: the next execution's input copy cannot overwrite static
  buffers that queued work still reads.
- Weights are captured by address: each instance remembers the Weights version it read, and an
  execution that loaded another version frees the stale graph (the instance is leased and its
  earlier GPU work finished) and captures it again at once on the same capture streams (no
  second warm-up: the kernels are warm). A graph holding old weights is never replayed for
  newer ones.
- A capture that raises (an op that syncs the host, say) marks its signature uncapturable for
  the Executor: the reason is kept, logged at WARNING, that execution runs again on the stream
  path, the signature's other instances are freed and its waiters take the stream path. A
  signature's first instance is captured alone, so such a capture is tried once.

`torch.cuda.graph(...)` is not used: its `__enter__` calls `torch.cuda.synchronize()` (the
whole device: the loop thread would block on every other execution's GPU work) and empties the
allocator's cache. The backend calls `CUDAGraph.capture_begin/capture_end` on the origin
stream instead, with `capture_error_mode="thread_local"`: other threads keep enqueueing their
executions' work while one thread captures.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import torch

from asyncgraph.cuda.capture import (
    CAPTURE_LOCK,
    CAPTURE_WAIT_S,
    CudaGraphs,
    clone_outputs,
    copy_inputs,
    empty_like,
    failure_text,
)
from asyncgraph.cuda.device import FrameStreams, StreamSet
from asyncgraph.cuda.instances import GraphInstance
from asyncgraph.cuda.segment_graphs import FrameSegments
from asyncgraph.runtime.units import Line, in_order, run_units
from asyncgraph.runtime.validation import Signature, signature_of

if TYPE_CHECKING:
    from asyncgraph.runtime.frame import ExecutionFrame


def frame_captures(owner: CudaGraphs, gpu: FrameStreams) -> FrameGraphs | None:
    """A frame's way into the whole-execution captures (Mode.CAPTURED replays the Executor's
    graph instances); None when its executions are not captured whole. A program that is not
    wholly capturable gets its segments' captures instead, which the frame's device state
    calls from its unit tables (inside the dataflow): the frame itself never sees them."""
    if owner.capture_plan.capturable:
        return FrameGraphs(owner, gpu)  # holds no graph: the instances are the Executor's
    if owner.segment_plan.segments:
        segments = FrameSegments(owner, gpu)
        gpu.segments = segments  # the GPU's unit tables call its segments
        owner.add_frame(segments)
    return None


class FrameGraphs:
    """A frame's way into the Executor's graph instances (instances.py): one execution at a
    time, the frame's, leases an instance of its input signature, replays it (or captures
    it) on the frame's streams, and gives it back. The frame keeps no graph of its own, only
    the fork and join events it records a capture with.

    `run` is the Executor's one branch: it returns False when this execution takes the stream
    path (warming up, an uncapturable signature, a failed capture, no instance to be had),
    and True once the frame's output slots hold this execution's outputs, the GPU work done.
    """

    __slots__ = ("_fork", "_gpu", "_joins", "_owner")

    def __init__(self, owner: CudaGraphs, gpu: FrameStreams) -> None:
        self._owner = owner
        self._gpu = gpu
        backend = owner.runtime.backend
        self._fork = backend.new_event()
        others = len(owner.runtime.plan.streams_used) - 1
        self._joins = [backend.new_event() for _ in range(others)]

    async def run(
        self, frame: ExecutionFrame, flat: list[Any], signature: Signature | None, version: int
    ) -> bool:
        """Run the loaded frame as a replay (or a capture) of an instance of its signature,
        once the signature has warmed up and an instance can be had."""
        owner = self._owner
        key = signature if signature is not None else signature_of(flat)
        if key is None or key in owner.failed:
            owner.count("fallbacks")  # under its lock: captures count from threads
            return False
        state = owner.instances.signature(key)
        # profiled by adaptive placement (timed node by node), or warming up: stream path
        if frame.times is not None or state.runs < owner.warmup:
            state.runs += 1
            owner.warmups += 1
            return False
        instance = await self._lease(key)
        if instance is None:  # none, and none can be made: no thread hop, no allocation
            owner.count("fallbacks")
            return False
        try:
            return await self._run_on(instance, frame, flat, key, version)
        finally:  # its GPU work is done (`finish` absorbs a cancellation until then)
            if instance.graph is None and key in owner.failed:
                owner.instances.forget(key)  # its waiters take the stream path
            owner.instances.give_back(instance)

    async def _lease(self, key: Signature) -> GraphInstance | None:
        """An instance of `key` this execution holds: idle, new (capture streams leased), or
        given back by another execution after a first-come-first-served wait; None when the
        signature has none and none can be made (or it failed meanwhile)."""
        owner = self._owner
        instances = owner.instances
        waited = False
        while True:
            state = instances.signature(key)
            instance = instances.take(state)
            if instance is not None or not state.count:
                return instance
            if not waited:
                waited = True
                instances.waits += 1
            instance = await instances.wait(state)
            if instance is not None:
                return instance
            if key in owner.failed:  # woken to look again: the signature failed meanwhile
                return None

    async def _run_on(
        self, instance: GraphInstance, frame: ExecutionFrame, flat: list[Any], key: Signature,
        version: int,
    ) -> bool:
        """Replay `instance`, or capture it first (new, or captured for other weights)."""
        owner = self._owner
        if instance.graph is not None and instance.version != version:
            instance.free_graph()  # weights changed: capture again at once (kernels are warm)
            owner.recaptures += 1
        if instance.graph is None:
            return await self._capture(frame, flat, key, version, instance)
        owner.replays += 1  # launched, whatever happens while it is awaited
        await self._replay(frame, flat, instance)
        return True

    # -- capture ------------------------------------------------------------------------------

    async def _capture(
        self, frame: ExecutionFrame, flat: list[Any], key: Signature, version: int,
        instance: GraphInstance,
    ) -> bool:
        """Capture this execution into `instance`, replay it once for its result; False when
        capture raised or waited too long for another (the frame is loaded again as it was,
        for the stream path).

        The capture runs on a worker thread (anyio's): warming the capture streams, recording
        every node and the first replay take milliseconds, which on the loop would stall every
        other request. The frame and the instance are this execution's alone meanwhile, and
        the capture is thread-local, so other threads go on enqueueing their work."""
        gpu = self._gpu
        gpu.begin(only=self._owner.capture_plan.origin)  # the rest runs on capture streams
        try:
            return await anyio.to_thread.run_sync(
                self._capture_here, frame.values, flat, key, version, instance
            )
        finally:
            await gpu.finish()  # absorbs cancellation until the GPU is done, then re-raises

    def _capture_here(
        self, values: list[Any], flat: list[Any], key: Signature, version: int,
        instance: GraphInstance,
    ) -> bool:
        """`_capture`'s work, on the calling thread (the instance's capture streams leased)."""
        owner = self._owner
        backend = owner.runtime.backend
        # Another capture may be recording: off the loop, this thread waits its turn (a capture
        # takes milliseconds and waits on nothing), and gives up only past CAPTURE_WAIT_S,
        # before anything is allocated for the capture.
        if not CAPTURE_LOCK.acquire(timeout=CAPTURE_WAIT_S):
            owner.count("fallbacks")
            return False
        loaded = list(values)
        try:
            handle = self._origin_handle()
            token = backend.enter_stream(handle)
            try:  # static inputs: made and filled on the origin stream, outside the graph pool
                static = [empty_like(x) for x in flat]
                copy_inputs(static, flat)
            finally:
                backend.leave_stream(token)
            for slot, buffer, x in zip(owner.input_slots, static, flat, strict=True):
                values[slot] = buffer if buffer is not None else x
            capture_set = instance.capture_set
            if instance.pool is None:
                instance.pool = backend.graph_pool()
            graph = backend.new_graph()
            origin = capture_set.streams[owner.capture_plan.origin]  # type: ignore[index]
            try:  # recorded on the instance's capture streams: no one else enqueues there
                self._warm(values, capture_set, origin)
                with self._gpu.recording_on(capture_set), backend.capture(
                    graph, instance.pool, backend.stream_handle(origin)
                ):
                    self._record(values)
            except Exception as exc:
                values[:] = loaded
                with contextlib.suppress(Exception):  # an invalidated capture has little to free
                    graph.reset()
                owner.mark_failed(key, failure_text(exc))
                return False
        finally:
            CAPTURE_LOCK.release()
        # The warm-up's kernels ran on the capture streams and read the static inputs; the
        # origin `finish` awaits (and the next replay's input copy) must come after them.
        self._leased_origin().wait_stream(origin)
        for slot, x in zip(owner.input_slots, flat, strict=True):
            values[slot] = x  # an input returned as an output is the caller's, not static
        outputs = {slot: values[slot] for slot in owner.capture_plan.produced_outputs}
        instance.captured(graph, static, outputs, version)
        owner.count("captures")
        token = backend.enter_stream(handle)
        try:
            graph.replay()
            self._clone_outputs(values, outputs)
        finally:
            backend.leave_stream(token)
        return True

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

    async def _replay(
        self, frame: ExecutionFrame, flat: list[Any], instance: GraphInstance
    ) -> None:
        """Inputs into the static buffers, one replay, outputs cloned out, all on the frame's
        origin stream after the caller's; then await the GPU (cancellation absorbed until
        done), so that the instance goes back with no work of this execution in flight."""
        backend = self._owner.runtime.backend
        gpu = self._gpu
        graph = instance.graph
        assert graph is not None, f"{instance!r} replayed uncaptured"
        gpu.begin(only=self._owner.capture_plan.origin)  # a replay is one launch on one stream
        try:
            token = backend.enter_stream(self._origin_handle())
            try:
                copy_inputs(instance.static_inputs, flat)
                graph.replay()
                self._clone_outputs(frame.values, instance.outputs)
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
