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

Capture ahead (`CaptureAhead`, below): the captures above are paid for by the execution that
makes them, after `graph_warmup` others ran uncaptured. `Executor.warm_up(example)` captures a
signature's instances (one signature per batch bucket when batching pads) before serving needs
them, and `CudaConfig.capture_ahead` does so for the first request of every signature (and
for a busy one that may grow, and for recaptures after a weights swap): one task on the loop
runs the captures in order, each on a worker thread with the signature's warm-up executions
before it, while executions of the signature run on the stream path (`before_ready`) without
waiting, and replay once an instance is ready. `CudaGraphStatistics.signatures` says where
each signature stands; `Executor.aclose` stops the captures ahead before freeing instances.

`torch.cuda.graph(...)` is not used: its `__enter__` calls `torch.cuda.synchronize()` (the
whole device: the loop thread would block on every other execution's GPU work) and empties the
allocator's cache. The backend calls `CUDAGraph.capture_begin/capture_end` on the origin
stream instead, with `capture_error_mode="thread_local"`: other threads keep enqueueing their
executions' work while one thread captures.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch

from asyncgraph.cuda.capture import (
    CAPTURE_LOCK,
    CAPTURE_WAIT_S,
    CudaGraphs,
    SignatureCapture,
    clone_outputs,
    copy_inputs,
    empty_like,
    failure_text,
    logger,
)
from asyncgraph.cuda.device import CudaGraph, FrameStreams, StreamSet
from asyncgraph.cuda.instances import GraphInstance, SignatureInstances
from asyncgraph.cuda.segment_graphs import FrameSegments
from asyncgraph.runtime.backend import current_loop
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
        once the signature has warmed up and an instance can be had.

        A bucket batch whose rows are not copied yet (runtime/bucket_inputs.py's BucketRows)
        has them copied straight into the instance's static inputs by a replay or a capture
        (`copy_inputs`)."""
        owner = self._owner
        key = signature if signature is not None else signature_of(flat)
        if key is None or key in owner.failed:
            owner.count("fallbacks")  # under its lock: captures count from threads
            return False
        state = owner.instances.signature(key)
        ahead = owner.capture_ahead or state.jobs > 0  # captured off the serving path
        # profiled by adaptive placement (timed node by node), or warming up: stream path
        if frame.times is not None or (
            state.runs < owner.warmup and not ahead and not state.proven
        ):
            state.runs += 1
            owner.warmups += 1
            return False
        if ahead:
            instance = await self._lease_ahead(key, frame, flat, version)
            if instance is None:  # counted: before_ready or a fallback
                return False
        else:
            instance = await self._lease(key)
            if instance is None:  # none, and none can be made: no thread hop, no allocation
                owner.count("fallbacks")
                return False
        try:
            replayed = await self._run_on(instance, frame, flat, key, version)
        finally:  # its GPU work is done (`finish` absorbs a cancellation until then)
            if instance.graph is None and key in owner.failed:
                owner.instances.forget(key)  # its waiters take the stream path
            owner.instances.give_back(instance)
        # the instance back before the execution waits for room in the loop's slice: others
        # queued for it replay meanwhile (benchmarks/gpu_host.py, 64 callers)
        await self._gpu.take_turn()
        return replayed

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

    async def _lease_ahead(
        self, key: Signature, frame: ExecutionFrame, flat: list[Any], version: int
    ) -> GraphInstance | None:
        """`_lease` where captures happen ahead (CaptureAhead): an idle instance captured for
        this execution's weights; else, while instances of the signature are replaying, one
        given back, first come first served; else None, and the execution runs on the stream
        path at once (counted `before_ready` while a capture ahead is queued or running,
        else a fallback), never waiting for a capture.

        With `CudaConfig.capture_ahead`, an execution that finds no idle instance while its
        signature may have one more queues its capture (one at a time per signature), and
        an instance captured for other weights is freed and queued for recapture."""
        owner = self._owner
        instances = owner.instances
        waited = False
        while True:
            state = instances.signature(key)
            instance = state.idle.pop() if state.idle else None
            if instance is not None and self._stale(instance, frame, flat, version):
                continue  # queued for recapture: look again
            if instance is not None:
                return instance
            if owner.capture_ahead and not state.jobs and instances.can_grow(state):
                capture_ahead(owner).request(state, frame.values, flat, version)
            if not state.replaying:  # nothing to wait for but captures
                owner.count("before_ready" if state.jobs else "fallbacks")
                return None
            if not waited:
                waited = True
                instances.waits += 1
            instance = await instances.wait(state)
            if instance is not None and not self._stale(instance, frame, flat, version):
                return instance
            if key in owner.failed:  # woken to look again: the signature failed meanwhile
                owner.count("fallbacks")
                return None

    def _stale(
        self, instance: GraphInstance, frame: ExecutionFrame, flat: list[Any], version: int
    ) -> bool:
        """Whether `instance` (leased) holds a graph of other weights that a capture ahead now
        recaptures (`CudaConfig.capture_ahead`); without it the execution recaptures it
        itself (`_run_on`)."""
        owner = self._owner
        if instance.graph is None or instance.version == version or not owner.capture_ahead:
            return False
        instance.free_graph()  # leased, its earlier GPU work finished
        owner.recaptures += 1
        capture_ahead(owner).request(instance.signature, frame.values, flat, version, instance)
        return True

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
            graph = self.record_graph(values, key, instance)
            if graph is None:
                values[:] = loaded
                return False
        finally:
            CAPTURE_LOCK.release()
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

    def record_graph(
        self, values: list[Any], key: Signature, instance: GraphInstance
    ) -> CudaGraph | None:
        """Capture the loaded `values` (static inputs in the input slots) into a new graph on
        `instance`'s capture streams, after one uncaptured run there (CAPTURE_LOCK held);
        None when the capture raised: the signature is marked failed. The frame's leased
        origin then waits for the capture origin: the warm-up's kernels ran there and read
        the static inputs, and `finish` (and the next replay's input copy) must come after."""
        owner = self._owner
        backend = owner.runtime.backend
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
            with contextlib.suppress(Exception):  # an invalidated capture has little to free
                graph.reset()
            owner.mark_failed(key, failure_text(exc))
            return None
        self._leased_origin().wait_stream(origin)
        return graph

    def warm_on(self, values: list[Any], instance: GraphInstance) -> None:
        """One uncaptured run of `values` on `instance`'s capture streams (a warm-up
        execution of a capture ahead, on its thread)."""
        capture_set = instance.capture_set
        origin = capture_set.streams[self._owner.capture_plan.origin]  # type: ignore[index]
        self._warm(values, capture_set, origin)

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
            await gpu.finish(turn=False)  # its turn after the instance is given back

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


# -- capture ahead (issue #50, item 2) ------------------------------------------------------------


_LOCK_POLL_S = 0.05  # how often a capture ahead waiting for CAPTURE_LOCK looks for a stop


class AheadJob:
    """One queued capture ahead: the signature, the values it runs on (the weights template
    with its own copies of the inputs, `static`, in the input slots), the Weights version
    they are, the instance it recaptures (None: a new one, leased when it starts), and
    `done`, set once it has ended whichever way."""

    __slots__ = ("done", "instance", "state", "static", "values", "version")

    def __init__(
        self, state: SignatureInstances, values: list[Any], static: list[Any], version: int,
        instance: GraphInstance | None,
    ) -> None:
        self.state = state
        self.values = values
        self.static = static
        self.version = version
        self.instance = instance
        self.done = anyio.Event()


async def warm_up(
    owner: CudaGraphs, examples: Sequence[tuple[list[Any], Signature | None]],
    template: list[Any], version: int,
) -> list[SignatureCapture]:
    """Capture ahead the instances of each example's input signature (`Executor.warm_up`):
    as many as a signature may have (`GraphInstances.per_signature`) and the capture streams
    allow, one per signature first, then a second for each, and so on, so that every
    signature (batch bucket) gets one before any gets many. `examples`: flat inputs, moved
    and validated, with their signature (None: computed here); `template`: the weights of
    Weights `version` in their slots. Returns once every capture asked for has ended, each
    signature's SignatureCapture in the order given; a signature whose capture fails is
    FAILED (with the error) and runs on the stream path, as ever. A cancelled caller stops
    waiting, not the captures (the Executor's; its close stops them)."""
    instances = owner.instances
    signatures: dict[Signature, list[Any]] = {}
    for flat, signature in examples:
        key = signature if signature is not None else signature_of(flat)
        if key is None:
            kinds = ", ".join(type(x).__name__ for x in flat)
            raise ValueError(
                f"warm_up needs inputs that are tensors or plain scalars, got ({kinds}): "
                "graphs are captured per input signature"
            )
        signatures.setdefault(key, flat)
    if len(signatures) > instances.max_signatures:
        raise ValueError(
            f"warm_up was asked for {len(signatures)} input signatures, but an Executor keeps "
            f"the graphs of {instances.max_signatures} (CudaConfig.max_captured_signatures): "
            "the first would be evicted by the last; ask for fewer (fewer batch buckets), or "
            "keep more"
        )
    ahead = capture_ahead(owner)
    wanted = {}
    for key in signatures:  # what it may have, less what it has or has queued
        state = instances.signature(key)
        wanted[key] = max(0, instances.per_signature - state.count - state.jobs)
    jobs: list[AheadJob] = []
    for round_ in range(max(wanted.values(), default=0)):
        for key, flat in signatures.items():
            if round_ >= wanted[key] or key in owner.failed:
                continue
            values = list(template)
            for slot, x in zip(owner.input_slots, flat, strict=True):
                values[slot] = x
            job = ahead.request(instances.signature(key), values, flat, version)
            if job is not None:
                jobs.append(job)
    for job in jobs:
        await job.done.wait()
    return [owner.signature_capture(key) for key in signatures]


def capture_ahead(owner: CudaGraphs) -> CaptureAhead:
    """The Executor's CaptureAhead, made on first use (no task, thread or event before)."""
    ahead = owner.ahead
    if ahead is None:
        ahead = owner.ahead = CaptureAhead(owner)
    assert isinstance(ahead, CaptureAhead)
    return ahead


class CaptureAhead:
    """Captures of graph instances made before executions need them, off the serving path.

    Why: an execution that captures (the inline path, `FrameGraphs._capture`) waits for the
    capture (milliseconds: a warm run, the recording, a replay), and the `graph_warmup`
    executions before it run uncaptured; a service wants its first requests to replay and
    none to wait for a capture. So the Executor's instances of a signature can be captured
    ahead: all it may have, at `Executor.warm_up` (at load, as vLLM captures its batch sizes
    at start-up; one signature per batch bucket when batching pads), or one at a time as
    executions find none idle (`CudaConfig.capture_ahead`).

    How: jobs queue here (loop thread), and one task on the loop runs them in order, one
    capture at a time, each on a worker thread (anyio's), never on the loop. A job leases
    its instance's capture streams when it starts (nothing is allocated before: a failed
    lease leaves the signature's status saying so), orders a stream set of its own after the
    loop's streams (`begin`: its inputs were copied there), runs the signature's warm-up
    executions uncaptured on the instance's capture streams (`graph_warmup` of them for a
    signature's first instance, one for the others: cuBLAS's per-stream workspace), captures
    under CAPTURE_LOCK, and awaits the GPU (`finish`) before the instance is given back:
    to the oldest execution waiting for one, else idle. Meanwhile executions of the
    signature run on the stream path (`before_ready`), never waiting for it.

    Weights: a job captures the version it was queued with; an execution that leases an
    instance of another version never replays it (graphs.py: recaptured ahead with
    `capture_ahead`, else by that execution). Close (`stop`): queued jobs are dropped, the
    running one stops before its capture (or ends it: milliseconds), its GPU work is
    awaited, and its instance freed; then `CudaGraphs.close` frees the rest.
    """

    def __init__(self, owner: CudaGraphs) -> None:
        self._owner = owner
        self._gpu = owner.runtime.frame_state(owner.raw_calls)  # a frame's GPU state, its own
        self._graphs = FrameGraphs(owner, self._gpu)  # the capture code a frame runs
        self._queue: deque[AheadJob] = deque()
        self._worker: Any = None  # the loop task running the queue, while there is one
        self._finished: anyio.Event | None = None  # set when that task ends
        self._stopping = threading.Event()  # read by the capturing thread
        self.closed = False

    def request(
        self, state: SignatureInstances, values: list[Any], flat: list[Any], version: int,
        instance: GraphInstance | None = None,
    ) -> AheadJob | None:
        """Queue a capture of `state`'s signature on `values` (a loaded frame's: the weights
        template and `flat` in the input slots) and Weights `version`; `instance`, leased and
        its graph freed, to recapture (else a new one). The inputs are copied now, on the
        loop's current stream: the copies are the instance's static inputs, and the caller
        may reuse its tensors once its call returns. None once stopped (`instance` given
        back, so freed)."""
        owner = self._owner
        if self.closed:
            if instance is not None:
                owner.instances.give_back(instance)
            return None
        static = [empty_like(x) for x in flat]
        copy_inputs(static, flat)
        loaded = list(values)
        for slot, buffer in zip(owner.input_slots, static, strict=True):
            if buffer is not None:
                loaded[slot] = buffer
        job = AheadJob(state, loaded, static, version, instance)
        state.jobs += 1
        if instance is not None:
            state.held += 1
        self._queue.append(job)
        if self._worker is None:
            self._finished = anyio.Event()
            self._worker = current_loop().create_task(self._work())
        return job

    async def stop(self) -> None:
        """Drop the queued jobs, stop the running one and wait for it (its thread and GPU
        work done, its instance given back or freed): the Executor is closing."""
        self.closed = True
        self._stopping.set()
        while self._queue:
            self._drop(self._queue.popleft(), "the executor closed before its capture")
        if self._worker is not None and self._finished is not None:
            await self._finished.wait()

    async def _work(self) -> None:
        """Run the queued jobs in order, one at a time, until none is left (the loop's task)."""
        try:
            while self._queue and not self.closed:
                job = self._queue.popleft()
                try:
                    await self._run(job)
                except Exception as exc:  # a bug of its own: its signature's status says so
                    job.state.reason = failure_text(exc)
                    logger.exception("capture ahead of %s failed", job.state.key)
                finally:
                    job.state.jobs -= 1
                    job.done.set()
        finally:
            self._worker = None
            if self._finished is not None:
                self._finished.set()

    def _drop(self, job: AheadJob, reason: str) -> None:
        """A queued job that will not run: its instance given back (freed: it holds no
        graph), its signature told why."""
        state = job.state
        state.jobs -= 1
        state.reason = reason
        if job.instance is not None:
            state.held -= 1
            self._owner.instances.give_back(job.instance)
        job.done.set()

    async def _run(self, job: AheadJob) -> None:
        """One job: lease its instance, capture on a thread, await the GPU, give it back."""
        owner = self._owner
        instances = owner.instances
        state = job.state
        instance = job.instance
        if state.evicted or state.key in owner.failed:
            if instance is not None:  # its signature is gone: freed as it comes back
                state.held -= 1
                instances.give_back(instance)
            return
        if instance is None:
            instance = instances.new_ahead(state)
            if instance is None:
                state.reason = (
                    f"no capture stream free for another instance ({state.count} held; "
                    "tried again once one is released)"
                    if state.count < instances.per_signature
                    else f"it has its most instances ({instances.per_signature})"
                )
                return
            state.held += 1
        state.capturing, state.reason = True, None
        gpu = self._gpu
        graph = None
        try:
            gpu.begin(only=owner.capture_plan.origin)  # after the inputs' copies
            try:
                graph = await anyio.to_thread.run_sync(self._capture, job, instance)
            finally:
                await gpu.finish()  # absorbs a cancellation until the GPU is done
            if graph is not None:  # its warm-up's GPU work done: replays may overwrite inputs
                outputs = {slot: job.values[slot] for slot in owner.capture_plan.produced_outputs}
                instance.captured(graph, job.static, outputs, job.version)
                owner.count("captures")
                owner.count("captured_ahead")
        finally:
            if graph is not None and instance.graph is not graph:
                graph.reset()  # captured, never handed over (the wait above raised)
            state.capturing = False
            state.held -= 1
            if instance.graph is None and state.key in owner.failed and not state.evicted:
                instances.forget(state.key)  # its waiters take the stream path
            instances.give_back(instance)

    def _capture(self, job: AheadJob, instance: GraphInstance) -> CudaGraph | None:
        """The job's warm-up executions and capture, on this (worker) thread: the graph,
        which the loop hands to `instance` once the GPU work is done; None when the capture
        failed, or, capturing nothing, once `stop` was asked."""
        owner = self._owner
        stopping = self._stopping
        key = job.state.key
        values = job.values
        graphs = self._graphs
        warm_runs = 1 if job.state.proven else max(1, owner.warmup)
        try:
            for _ in range(warm_runs - 1):  # the signature's warm-up, before the lock
                if stopping.is_set():
                    return None
                graphs.warm_on(values, instance)
        except Exception as exc:  # the program fails on these inputs: uncaptured from now
            owner.mark_failed(key, failure_text(exc))
            return None
        while not CAPTURE_LOCK.acquire(timeout=_LOCK_POLL_S):  # another capture records
            if stopping.is_set():
                return None
        try:
            if stopping.is_set():
                return None
            return graphs.record_graph(values, key, instance)
        finally:
            CAPTURE_LOCK.release()


# -- segments (issue #15) -------------------------------------------------------------------------
