"""Captured segments: the runs of capturable nodes of a GPU program that is not wholly
capturable, each one unit of the schedule, warmed up, captured and replayed per frame.

segments.py plans them (pure); this module is the frame's side (`FrameSegments`), on the
capture machinery every capture shares (capture.py). graphs.py's docstring tells why CUDA
graphs, and how whole executions are captured.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from asyncgraph.cuda.capture import (
    CAPTURE_LOCK,
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
from asyncgraph.cuda.device import FrameStreams
from asyncgraph.cuda.segments import Segment
from asyncgraph.cuda.streams import Role, StreamKey
from asyncgraph.runtime.units import Line, in_order, run_units


class FrameSegments:
    """The segment captures of one frame (asyncgraph/cuda/segments.py), per segment and per
    signature of the segment's own inputs.

    A segment is one unit of the schedule; its call (`segment_call`) runs on the thread the
    scheduler runs CUDA units on, inside the execution (`FrameStreams.begin` has leased the
    stream set, `finish` awaits it), and never waits on the host:

    - warm-up (the first `cuda.graph_warmup` runs of a signature), an uncapturable signature
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

    A segment's capture is of one weights version: the frame's device state carries the
    loaded execution's (`FrameStreams.weights_version`), and a capture of another is redone.
    """

    __slots__ = (
        "__weakref__", "_after", "_gpu", "_lease", "_marks", "_owner", "_states", "_tables",
    )

    def __init__(self, owner: CudaGraphs, gpu: FrameStreams) -> None:
        self._owner = owner
        self._gpu = gpu
        backend = owner.runtime.backend
        self._states: list[OrderedDict[Any, CaptureState]] = [
            OrderedDict() for _ in owner.segment_plan.segments
        ]
        self._marks = {key: backend.new_event() for key in owner.runtime.plan.streams_used}
        self._after = backend.new_event()
        self._lease = FrameLease()  # the frame's capture streams, leased at first capture
        ids = owner.value_ids
        # Per segment, the uncaptured path's calls and store slots (`_stream_path`).
        self._tables = [
            (tuple(gpu.calls[n] for n in seg.nodes), tuple(ids[n] for n in seg.nodes))
            for seg in owner.segment_plan.segments
        ]

    @property
    def live(self) -> int:
        return sum(1 for states in self._states for s in states.values() if s.capture)

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
        self._lease.release()  # the frame's capture streams go back (CaptureStreamLeases)

    def run_segment(self, index: int, values: list[Any]) -> None:
        """Run segment `index` of the loaded execution: on the stream path (warm-up, a failed
        or busy capture), as a capture, or as a replay (the class docstring)."""
        owner = self._owner
        seg = owner.segment_plan.segments[index]
        key = _segment_key(seg, values)
        if key is None or (index, key) in owner.segment_failed:
            owner.count("segment_fallbacks")
            self._stream_path(index, seg, values)
            return
        state = self._state(index, key)
        capture = state.capture
        if capture is not None:
            if capture.version == self._gpu.weights_version:
                owner.count("segment_replays")
                self._launch(seg, capture, values)
                return
            capture.free()  # weights changed: capture again at once
            state.capture = None
            owner.count("recaptures")
        elif state.runs < owner.warmup:
            state.runs += 1
            owner.count("segment_warmups")
            self._stream_path(index, seg, values)
            return
        if not CAPTURE_LOCK.acquire(blocking=False):  # another capture is recording
            owner.count("segment_fallbacks")
            self._stream_path(index, seg, values)
            return
        try:
            state.capture = self._capture(index, seg, values, key)
        finally:
            CAPTURE_LOCK.release()
        if state.capture is None:
            self._stream_path(index, seg, values)

    def _state(self, index: int, key: Any) -> CaptureState:
        return lru_state(self._states[index], key, self._evicted)

    def _evicted(self) -> None:
        self._owner.count("evictions")  # segments run on worker threads: under the lock

    def _stream_path(self, index: int, seg: Segment, values: list[Any]) -> None:
        """Segment `index`'s nodes in order on their planned streams (the uncaptured path)."""
        nodes = seg.nodes

        def failed(run: Line, position: int, exc: BaseException) -> None:
            with contextlib.suppress(AttributeError):  # names the node: failed_node
                exc.asyncgraph_node = nodes[position]  # type: ignore[attr-defined]
            raise exc

        calls, stores = self._tables[index]
        run_units(Line(values, calls, stores, seg.drops), in_order(len(nodes)), failed)

    def _capture(
        self, index: int, seg: Segment, values: list[Any], key: Any
    ) -> Capture | None:
        """Capture segment `seg` and replay it once for this execution; None when capture
        raised (the signature is then marked uncapturable, the reason logged once) or when
        no capture stream is free (CaptureStreamLeases: tried again after a release)."""
        owner = self._owner
        backend = owner.runtime.backend
        streams = self._capture_streams()
        if streams is None:
            owner.count("segment_fallbacks")
            return None
        stream_set = self._gpu.stream_set
        assert stream_set is not None
        origin = stream_set.streams[seg.origin]
        self._order_before(seg, origin)
        token = backend.enter_stream(backend.stream_handle(origin))
        try:  # static inputs: made and filled on the origin stream, outside the graph pool
            weights = set(seg.weights)
            static = [
                None if v in weights else empty_like(values[v]) for v in seg.inputs
            ]
            copy_inputs(static, [values[v] for v in seg.inputs])
        finally:
            backend.leave_stream(token)
        private = list(values)  # the frame's slots stay as they are for the other units
        for slot, buffer in zip(seg.inputs, static, strict=True):
            if buffer is not None:
                private[slot] = buffer
        graph, pool = backend.new_graph(), backend.graph_pool()
        try:
            # Once uncaptured on the capture streams, on this thread: libraries allocate per
            # (thread, stream) state on first use (cuBLAS's workspace), which would otherwise
            # be allocated inside the capture, in the graph's pool.
            ready = backend.new_event()
            ready.record(origin)
            streams[seg.origin].wait_event(ready)  # after the static inputs
            self._record(seg, list(private), streams)
            with backend.capture(graph, pool, self._lease.handles[seg.origin]):
                self._record(seg, private, streams)
        except Exception as exc:
            with contextlib.suppress(Exception):
                graph.reset()
            owner.mark_segment_failed(index, key, failure_text(exc))
            return None
        outputs = {slot: private[slot] for slot in seg.outputs}
        capture = Capture(graph, pool, static, outputs, self._gpu.weights_version)
        owner.count("segment_captures")
        self._launch(seg, capture, values)
        return capture

    def _capture_streams(self) -> dict[StreamKey, Any] | None:
        """The frame's capture streams (FrameLease), or None while every capture stream is
        held by other frames."""
        runtime = self._owner.runtime
        return self._lease.get(runtime.backend, runtime.plan.streams_used)

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
        inner: dict[int, Any] = {}  # the events recorded inside, by node
        names = owner.graph.nodes

        def on_stream(position: int, node: int) -> Callable[[list[Any]], Any]:
            """Node `node`'s call inside the capture: on its stream, after the events of
            its sources, recording its own when a later node waits on it."""
            key = plan.key(node)
            stream, handle, call = streams[key], self._lease.handles[key], raw[node]
            sources = seg.sources[position]

            def recorded(values: list[Any]) -> Any:
                for source in sources:
                    stream.wait_event(inner[source])
                token = backend.enter_stream(handle)
                try:
                    result = call(values)
                finally:
                    backend.leave_stream(token)
                if node in waited:
                    event = inner[node] = backend.new_event()
                    event.record(stream)
                return result

            return recorded

        def failed(run: Line, position: int, exc: BaseException) -> None:
            node = seg.nodes[position]
            exc.add_note(
                f"while capturing node {names[node].name!r} ({names[node].target_name()})"
            )
            with contextlib.suppress(Exception):  # an invalidated capture refuses it
                _join(backend, origin, others)  # so that a valid capture can still end
            raise exc

        calls = [  # ALIAS / META nodes: on the host, no GPU data
            on_stream(position, node) if plan.roles[node] is Role.CUDA else raw[node]
            for position, node in enumerate(seg.nodes)
        ]
        line = Line(values, calls, [ids[n] for n in seg.nodes], seg.drops)
        run_units(line, in_order(len(calls)), failed)
        _join(backend, origin, others)

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
            copy_inputs(capture.static_inputs, [values[v] for v in seg.inputs])
            for slot in seg.made_inputs:  # node-made: freed after this unit, read on origin
                backend.record_stream(values[slot], origin)
            capture.graph.replay()
            clone_outputs(values, capture.outputs)
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


def _join(backend: Any, origin: Any, others: list[Any]) -> None:
    """Join every forked stream back to the origin: a capture ends only with all joined."""
    for stream in others:
        join = backend.new_event()
        join.record(stream)
        origin.wait_event(join)
