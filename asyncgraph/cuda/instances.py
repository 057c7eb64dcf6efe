"""Captured graph instances, apart from frames: what a whole-execution capture owns, and the
Executor's pool of them per input signature.

Why: a CUDA graph bakes in the addresses of what it was captured with: its static inputs and
outputs, its memory pool, and the workspace cuBLAS keeps per (handle, stream) for each of its
capture streams. Two replays at once must not share any of these, so each graph must own its
capture streams. torch hands capture streams out round-robin from 32 per device and priority;
a plan on 4 streams therefore has room for 8 graphs at once, per device, in the process.
When each frame leased capture streams for its whole life, 8 of the
benchmark's 64 frames could ever capture, and every other frame, past its warm-up, paid on
every execution for `begin`, a thread hop, static input buffers and a copy before the lease
said no, and ran on the stream path: on an H200, graphs were 2.1x slower than no graphs.

So the graphs are not the frames'. Per input signature the Executor (its `CudaGraphs`) keeps
a few `GraphInstance`s, and an execution in Mode.CAPTURED leases one the way it leases a frame:

- An idle instance of its signature at once; else a new one, when the signature has fewer than
  its bound (`MAX_INSTANCES`, and no more than the Executor's frames) and capture streams are
  free: they are leased first (`CAPTURE_STREAMS`), before anything is allocated for the
  instance or a thread is asked to capture it. 64 frames share the 8 instances that 32
  capture streams allow, instead of 8 frames capturing and 56 retrying. A signature's first
  instance is captured alone (the others wait for it): a capture that fails (an op that syncs)
  is tried once, not once per execution that arrived meanwhile.
- Else, when its signature has instances (captured or being captured), it waits for one:
  first come first served (runtime/gate.py's HandOffQueue; a cancelled waiter leaves no entry,
  one cancelled after it was handed an instance passes it on). An instance goes back only
  after its replay's outputs are cloned and its GPU work is finished (`FrameStreams.finish`
  absorbs a cancellation until then), so a waiter never replays over work in flight.
- Else (no instance, and none can be made) the stream path, with no thread hop. A failed lease
  is remembered (the `CAPTURE_STREAMS.generation` it failed at) and tried again only after
  some holder released capture streams: no execution pays for a capture that cannot happen.
  A signature with no instance may take the capture streams of an idle instance of another
  signature that has more than one (`_reclaim`), so one signature cannot starve the others.

The least recently used signature past `MAX_CAPTURES` is evicted: its idle instances are
freed (graph, pool, capture streams), its busy ones when they come back, and its waiters look
again. An instance captured for another Weights version is freed and recaptured on its own
capture streams by the execution that leased it (graphs.py), never replayed for newer weights.
The instances are freed, and every capture stream released, when the Executor closes.

Memory: each instance has a pool of its own (replays of two instances run at once), so what
captures hold is at most (capture streams per device / the plan's streams) x the largest
signature's intermediates, what the frames that could capture held before.

Captures ahead (graphs.py's CaptureAhead: `Executor.warm_up`, `CudaConfig.capture_ahead`)
lease instances here too, under the same bounds (`new_ahead`), and hold them until captured;
executions never wait for an instance a capture holds (`SignatureInstances.replaying`).

The capture streams' leases (`CaptureStreamLeases`, `FrameLease`) live here too: segments
(segment_graphs.py), captured inside an execution, still lease theirs per frame.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from asyncgraph.cuda.device import Backend, CudaGraph, CudaRuntime, StreamSet
from asyncgraph.cuda.streams import StreamKey
from asyncgraph.runtime.gate import HandOffQueue
from asyncgraph.runtime.validation import Signature

MAX_INSTANCES = 8
"""Instances one input signature may have at once (and never more than the Executor's
frames, `max_concurrent_executions`). Capture streams bound them anyway (32 per device / the
plan's streams: 8 for 4 streams); this bounds the memory of a plan on fewer streams, where
each further instance adds a pool and static buffers for concurrency that one GPU rarely
has. Per signature, not per Executor: the capture streams are the Executor-wide bound."""


# -- capture streams ------------------------------------------------------------------------------


class CaptureStreamLeases:
    """The capture streams that graph instances and frames' segments hold: no two holders
    capture on one.

    cuBLAS keeps a workspace per (handle, stream), and a graph captured on a stream bakes that
    workspace's address into its GEMMs. torch hands capture streams out round-robin from a
    pool of 32 per device and priority, so a 33rd holder would get a stream another holder's
    graphs were captured on, and the two replaying at once would share one workspace:
    split-K GEMMs racing on it give wrong results without an error. So a holder (a graph
    instance, or a frame's segments) leases its capture streams for as long as it lives
    (released when it is freed or collected), a lease never hands out a stream another
    holder has, and a lease that finds none free captures nothing.
    """

    TRIES = 33  # one more than torch's pool per device and priority: a full round

    def __init__(self) -> None:
        self._lock = threading.Lock()  # segments capture on worker threads
        self._held: set[Any] = set()  # stream handles (Backend.stream_handle) leased now
        self.generation = 0  # counts releases: a failed lease is worth retrying after one

    def lease(self, backend: Backend, keys: Sequence[StreamKey]) -> dict[StreamKey, Any] | None:
        """A capture stream for each (device, index) key that no holder has, now held by the
        caller; None (nothing held) when a device has none free."""
        taken: dict[StreamKey, Any] = {}
        with self._lock:
            for key in keys:
                for _ in range(self.TRIES):
                    stream = backend.new_capture_stream(key[0])
                    handle = backend.stream_handle(stream)
                    if handle not in self._held:
                        self._held.add(handle)
                        taken[key] = stream
                        break
                else:
                    for stream in taken.values():
                        self._held.discard(backend.stream_handle(stream))
                    return None
        return taken

    def release(self, handles: Iterable[Any]) -> None:
        with self._lock:
            for handle in handles:
                self._held.discard(handle)
            self.generation += 1

    @property
    def held(self) -> int:
        """Capture streams leased now (all devices)."""
        return len(self._held)


CAPTURE_STREAMS = CaptureStreamLeases()
"""The process's capture-stream leases (one table: the pool they come from is torch's)."""


class FrameLease:
    """One holder's capture streams (a graph instance's, or a frame's segments'), leased once
    from CAPTURE_STREAMS and given back on `release` or when the holder is collected. A failed
    lease is tried again only after some holder released streams."""

    __slots__ = ("__weakref__", "_failed_at", "_release", "handles", "streams")

    def __init__(self) -> None:
        self.streams: dict[StreamKey, Any] = {}
        self.handles: dict[StreamKey, Any] = {}  # Backend.stream_handle of each
        self._release: weakref.finalize[Any, Any] | None = None
        self._failed_at = -1  # CAPTURE_STREAMS.generation when no streams were free

    def get(self, backend: Backend, keys: Sequence[StreamKey]) -> dict[StreamKey, Any] | None:
        """The leased streams, leasing them on first use; None while none are free."""
        if self.streams:
            return self.streams
        generation = CAPTURE_STREAMS.generation  # before: a release meanwhile means retry
        if self._failed_at == generation:
            return None
        streams = CAPTURE_STREAMS.lease(backend, keys)
        if streams is None:
            self._failed_at = generation
            return None
        self.streams = streams
        self.handles = {key: backend.stream_handle(s) for key, s in streams.items()}
        self._release = weakref.finalize(
            self, CAPTURE_STREAMS.release, list(self.handles.values())
        )
        return streams

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
            self.streams, self.handles = {}, {}


# -- instances ------------------------------------------------------------------------------------


class GraphInstance:
    """One captured whole execution of one input signature: its static inputs (the buffers a
    replay reads, filled from the caller's inputs), its static outputs (frame slot -> the
    value a replay writes), its CUDA graph, its memory pool, its capture streams (a StreamSet
    over its lease) and the Weights version it read. Replayed by one execution at a time: the
    one that leased it (`GraphInstances.take` / `wait`).

    `graph` is None until the first capture succeeded, and again once freed (a weights swap
    frees it before the recapture; the pool and capture streams stay with the instance)."""

    __slots__ = (
        "capture_set", "graph", "lease", "outputs", "pool", "signature", "static_inputs",
        "version",
    )

    def __init__(self, signature: SignatureInstances, lease: FrameLease, capture_set: StreamSet):
        self.signature = signature
        self.lease = lease
        self.capture_set = capture_set  # the leased capture streams, by the plan's keys
        self.graph: CudaGraph | None = None
        self.pool: Any = None  # made at the first capture (after the lease), kept after
        self.static_inputs: list[Any] = []  # per flat input: its buffer, or None
        self.outputs: dict[int, Any] = {}
        self.version = -1

    def captured(
        self, graph: CudaGraph, static_inputs: list[Any], outputs: dict[int, Any], version: int
    ) -> None:
        """The capture succeeded (called on the capturing thread)."""
        self.static_inputs = static_inputs
        self.outputs = outputs
        self.version = version
        self.graph = graph

    def free_graph(self) -> None:
        """Free the graph and its static buffers (its GPU work is done); keep the streams."""
        graph, self.graph = self.graph, None
        self.static_inputs, self.outputs = [], {}
        if graph is not None:
            graph.reset()

    def close(self) -> None:
        """Free everything and give the capture streams back."""
        self.free_graph()
        self.pool = None
        self.lease.release()

    def __repr__(self) -> str:
        state = "captured" if self.graph is not None else "uncaptured"
        return f"<GraphInstance {state} v{self.version} {self.signature.key}>"


class SignatureInstances:
    """One input signature's instances and what waits for them (loop thread only).

    Captures ahead (graphs.py's CaptureAhead) count here too: `jobs` queued or running for
    the signature, `held` the instances they hold (a recapture's from the moment it is
    queued, a new one's from its lease), `capturing` while one records on the thread, and
    `reason` why the last one captured nothing (no capture stream free, the Executor closed).
    """

    __slots__ = (
        "capturing", "count", "evicted", "held", "idle", "jobs", "key", "proven", "reason",
        "runs", "waiters",
    )

    def __init__(self, key: Signature) -> None:
        self.key = key
        self.runs = 0  # executions on the stream path so far (warm-up)
        self.count = 0  # instances that hold capture streams: idle, leased or being captured
        self.idle: list[GraphInstance] = []
        self.waiters: HandOffQueue[GraphInstance | None] = HandOffQueue()
        self.evicted = False  # no longer the Executor's: instances freed as they come back
        # a capture of it succeeded: until then one instance at a time is captured, so that a
        # signature whose capture fails costs one attempt, not one per execution arriving
        self.proven = False
        self.jobs = 0  # captures ahead queued or running for it
        self.held = 0  # instances those jobs hold (neither idle nor replaying)
        self.capturing = False  # one of them records now, on its thread
        self.reason: str | None = None  # why the last capture ahead captured nothing

    @property
    def replaying(self) -> int:
        """Instances leased by executions (replaying, or capturing inline): what a waiter
        can expect back soon. Those held by captures ahead are not counted: nobody waits
        for a capture."""
        return self.count - len(self.idle) - self.held


class GraphInstances:
    """An Executor's graph instances by input signature (see the module docstring).

    Loop thread only: executions lease and return instances there; the capture itself runs on
    a worker thread but touches only the instance it leased.

    Args:
        runtime: the Executor's CudaRuntime (the stream plan, the backend).
        frames: the Executor's frames (`max_concurrent_executions`): no signature has more
            instances than executions can use at once.
        max_signatures: signatures kept (capture.py's MAX_CAPTURES), least recently used
            evicted past it.
    """

    def __init__(self, runtime: CudaRuntime, frames: int, max_signatures: int) -> None:
        self._runtime = runtime
        self.per_signature = max(1, min(frames, MAX_INSTANCES))
        self._max_signatures = max_signatures
        self._signatures: OrderedDict[Signature, SignatureInstances] = OrderedDict()
        self._all: set[GraphInstance] = set()
        self._failed_at = -1  # CAPTURE_STREAMS.generation when a lease last found none free
        self.waits = 0  # executions that waited for an instance
        self.lease_failures = 0  # capture-stream leases that failed
        self.evictions = 0  # captured instances freed for another signature

    @property
    def live(self) -> int:
        """Instances holding a captured graph."""
        return sum(1 for instance in self._all if instance.graph is not None)

    @property
    def waiting(self) -> int:
        """Executions queued for an instance (one cancelled leaves at once, as frames'
        waiters do: HandOffQueue)."""
        return sum(len(state.waiters) for state in self._signatures.values())

    def __iter__(self) -> Iterator[GraphInstance]:
        """Every instance holding capture streams now (idle, leased or being captured)."""
        return iter(list(self._all))

    def signature(self, key: Signature) -> SignatureInstances:
        """The instances of `key`, now the most recently used signature: new ones when there
        are none, which evicts the least recently used signature past the bound."""
        state = self._signatures.get(key)
        if state is not None:
            self._signatures.move_to_end(key)
            return state
        if len(self._signatures) >= self._max_signatures:
            _, old = self._signatures.popitem(last=False)
            self._evict(old, counted=True)
        state = self._signatures[key] = SignatureInstances(key)
        return state

    def captured(self, state: SignatureInstances) -> int:
        """Instances of `state` holding a captured graph (idle, replaying or stale)."""
        return sum(1 for i in self._all if i.signature is state and i.graph is not None)

    def find(self, key: Signature) -> SignatureInstances | None:
        """The instances of `key` if it is kept (not made, not moved in the LRU order)."""
        return self._signatures.get(key)

    def signatures(self) -> list[SignatureInstances]:
        """The signatures kept, least recently used first."""
        return list(self._signatures.values())

    @property
    def max_signatures(self) -> int:
        """Signatures kept at once (capture.py's MAX_CAPTURES)."""
        return self._max_signatures

    def can_grow(self, state: SignatureInstances) -> bool:
        """Whether `state` may have one more instance: under its bound, and no capture-stream
        lease has failed since the last release (one that has would fail again)."""
        return (state.count < self.per_signature
                and self._failed_at != CAPTURE_STREAMS.generation)

    def new_ahead(self, state: SignatureInstances) -> GraphInstance | None:
        """A new instance of `state` for a capture ahead (its capture streams leased, nothing
        allocated), under the signature's bound; a signature with none may reclaim another's
        idle second (as `take`). None when none can be had."""
        if state.count >= self.per_signature:
            return None
        instance = self._new(state)
        if instance is None and not state.count and self._reclaim(state):
            instance = self._new(state)
        return instance

    def take(self, state: SignatureInstances) -> GraphInstance | None:
        """An idle instance of `state`, else a new one (its capture streams leased, nothing
        captured or allocated yet), else None (the caller waits, or takes the stream path)."""
        if state.idle:
            return state.idle.pop()  # the most recently used: its memory is warmest
        if state.count >= self.per_signature or (state.count and not state.proven):
            return None
        instance = self._new(state)
        if instance is None and not state.count and self._reclaim(state):
            instance = self._new(state)
        return instance

    async def wait(self, state: SignatureInstances) -> GraphInstance | None:
        """Wait, first come first served, for an instance of `state` another execution gives
        back; None: look again (an instance was lost, or the signature evicted or failed)."""

        def pass_on(handed: GraphInstance | None) -> None:  # handed, then cancelled
            if handed is not None:
                self.give_back(handed)
            else:
                state.waiters.hand_over(None)

        return await state.waiters.wait(pass_on)

    def give_back(self, instance: GraphInstance) -> None:
        """The execution that leased `instance` is done with it, its GPU work finished: to the
        oldest waiter, else idle; freed when it holds no graph or its signature was evicted."""
        state = instance.signature
        if state.evicted or instance.graph is None:
            self._drop(instance)
            if not state.evicted and state.count:
                state.waiters.hand_over(None)  # one waiter may lease a replacement
            return
        if not state.waiters.hand_over(instance):
            state.idle.append(instance)
        if not state.proven:  # its first capture: waiters may now make instances of their own
            state.proven = True
            for _ in range(self.per_signature - state.count):
                if not state.waiters.hand_over(None):
                    break

    def forget(self, key: Signature) -> None:
        """`key` is not captured any more (its capture failed): free its instances, and its
        waiters take the stream path."""
        state = self._signatures.pop(key, None)
        if state is not None:
            self._evict(state, counted=False)

    def close(self) -> None:
        """Free every instance and release every capture stream (the Executor closes: every
        frame is idle, so every instance is)."""
        for state in self._signatures.values():
            state.evicted = True
            state.idle.clear()
        self._signatures.clear()
        for instance in list(self._all):
            instance.close()
        self._all.clear()

    def _new(self, state: SignatureInstances) -> GraphInstance | None:
        """A new instance of `state` on freshly leased capture streams; None when none are
        free (remembered until some holder releases streams)."""
        generation = CAPTURE_STREAMS.generation
        if self._failed_at == generation:
            return None
        runtime = self._runtime
        lease = FrameLease()
        streams = lease.get(runtime.backend, runtime.plan.streams_used)
        if streams is None:
            self._failed_at = generation
            self.lease_failures += 1
            return None
        instance = GraphInstance(state, lease, StreamSet(-1, streams, runtime.plan,
                                                         runtime.backend))
        state.count += 1
        self._all.add(instance)
        return instance

    def _drop(self, instance: GraphInstance) -> None:
        """Free `instance` (idle, or given back) and release its capture streams; when its
        signature has no instance left, its waiters look again (they would wait forever)."""
        instance.close()
        self._all.discard(instance)
        state = instance.signature
        state.count -= 1
        if not state.count:
            while state.waiters.hand_over(None):
                pass

    def _evict(self, state: SignatureInstances, counted: bool) -> None:
        """`state` is no longer kept: its idle instances freed now, its busy ones when they
        come back; its waiters look again."""
        state.evicted = True
        if counted:
            self.evictions += sum(
                1 for i in self._all if i.signature is state and i.graph is not None
            )
        idle, state.idle = state.idle, []
        for instance in idle:
            self._drop(instance)
        while state.waiters.hand_over(None):
            pass

    def _reclaim(self, needy: SignatureInstances) -> bool:
        """Free an idle instance of the signature with the most instances (more than one), so
        that `needy`, which has none, can lease its capture streams; False when none is."""
        richest = max(
            (s for s in self._signatures.values() if s is not needy and s.idle and s.count > 1),
            key=lambda s: s.count, default=None,
        )
        if richest is None:
            return False
        self.evictions += 1
        self._drop(richest.idle.pop(0))  # the least recently used of its idle ones
        return True
