"""Executor: the public face. `out = await executor.execute(x)`.

One execution, as data flowing through (see ARCHITECTURE.md):
cancellation check -> flatten and validate (the inputs' signature) -> take a frame ->
placement and schedule (found by the signature) -> load weights and inputs -> run the
WorkUnits (a measured all-inline schedule as a straight line, without a coroutine) -> take
the outputs, apply mutations -> clear and return the frame -> unflatten.

The Executor holds only what all executions share (plan, weights, pools); everything of one
execution lives in its frame.

A program with CUDA nodes (placement DEVICE) also gets a device plan from the device backend
registered as "cuda" (runtime/device.py's seam; cuda/backend.py: a StreamPlan and a
CudaRuntime, the stream sets of all its executions); each frame owns the GPU state of its
executions, and the scheduler enqueues CUDA nodes on their streams (docs/gpu.md). This module
reaches cuda/ only through that plan, and never imports it. A program without CUDA nodes
builds none of that and never touches torch.cuda, so CPU-only machines never initialise CUDA.
A GPU program whose nodes can all be captured (`cuda_graph_plan`, asyncgraph/cuda/graphs.py)
also gets capture state per frame: after warm-up, an execution is one CUDA-graph replay, the
one branch before the dataflow in `_execute`. Otherwise its segments (`cuda_segment_plan`,
asyncgraph/cuda/segments.py) are captured, each one unit of the schedule.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import operator
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
from torch.utils import _pytree as pytree

from asyncgraph.errors import ExecutorClosedError
from asyncgraph.graph.importers import Program, ProgramLike, to_program
from asyncgraph.graph.ir import Graph, InputKind, OutputKind, Ref
from asyncgraph.kernels import KernelFactory, OpKernel
from asyncgraph.kernels.base import KernelConfig
from asyncgraph.kernels.control_flow import SubgraphKernel
from asyncgraph.kernels.factory import default_inner_executor, device_dispatch_keys
from asyncgraph.passes.folding import ConstantFolder
from asyncgraph.runtime import registry
from asyncgraph.runtime.backend import (
    Caller,
    Loop,
    cancel_pending,
    current_loop,
    runs_here,
    task_of,
)
from asyncgraph.runtime.batching import BatcherStatistics, make_batcher
from asyncgraph.runtime.bucket_inputs import BucketRows
from asyncgraph.runtime.build import PassCounts, build
from asyncgraph.runtime.config import BatchingConfig, ExecutorConfig, requested_batching
from asyncgraph.runtime.delegates import Delegate, fast_form_backends, segment_backend
from asyncgraph.runtime.device import dispatch_keys, move_inputs_to_device
from asyncgraph.runtime.direct import ON_NEXT, ON_WORKER, DirectCall
from asyncgraph.runtime.form_verdicts import FormVerdicts
from asyncgraph.runtime.forms import MIN_FORM_NODES, THREAD_COUNTS, FastForms
from asyncgraph.runtime.frame import ExecutionFrame
from asyncgraph.runtime.instrument import Instrument, make_tracer
from asyncgraph.runtime.modes import Mode, ModeChooser
from asyncgraph.runtime.placement import NodeTimes, PlacementStatistics
from asyncgraph.runtime.plan import ExecutionPlan, Placement
from asyncgraph.runtime.pool import FramePool, FramePoolStatistics
from asyncgraph.runtime.schedule import Schedule, ScheduleStatistics
from asyncgraph.runtime.scheduler import Scheduler
from asyncgraph.runtime.validation import InputValidator, Signature
from asyncgraph.runtime.weights import PreparedWeights, Weights, ran_on
from asyncgraph.runtime.workers import WorkerPool, WorkerPoolStatistics

# An execution's placement, its node times to record (None unless profiled) and its schedule
# (None until built): Executor._choose
_Choice = tuple[tuple[Placement, ...], NodeTimes | None, Schedule | None]

_COMPLETED, _FAILED, _CANCELLED = range(3)  # how an execution ended: Executor._ended
_FRAMELESS, _LINE_NOW, _CAPTURED = Mode.FRAMELESS, Mode.LINE_NOW, Mode.CAPTURED
_DIRECT, _DIRECT_WORKER, _DIRECT_NEXT = Mode.DIRECT, Mode.DIRECT_WORKER, Mode.DIRECT_NEXT
ONE_CALL_FRAMES = 8  # a one-delegate-call form's frames per frame of the Executor's bound


def _idle(timeout: float) -> bool:
    """A delegate without a builder is always idle."""
    return True


@dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    """A snapshot of an Executor: executions by outcome, frames, workers, weights."""

    started: int
    completed: int
    failed: int
    cancelled: int
    in_flight: int
    frames: FramePoolStatistics
    workers: WorkerPoolStatistics
    weights_version: int
    nodes: int
    folded_nodes: int
    closed: bool
    schedules: ScheduleStatistics
    worker_executions: int = 0  # straight lines run on a worker thread (they overlapped others)
    frameless_executions: int = 0  # straight lines run at once without a frame (_run_alone)
    # input signatures remembered as valid: inputs alike skip the full check (validation.py)
    validated_signatures: int = 0
    # executions by the mode they ran in (runtime/modes.py's Mode names): FRAMELESS those
    # that completed (frameless_executions); LINE_NEXT those that waited an iteration,
    # whether they then ran at once or in slices
    modes: dict[str, int] = field(default_factory=dict)
    # the fast forms (runtime/forms.py): which serves each signature and why; None when
    # fast_paths is off or does not apply
    forms: dict[str, Any] | None = None


class Executor:
    """Runs a program (ExportedProgram, .pt2 path, fx GraphModule, Graph) from async code.

    One Executor serves many concurrent callers; at most `max_concurrent_executions` run at
    once and the others wait their turn. Use it as `async with Executor(p) as ex:` or call
    `await ex.aclose()` when done; resources start lazily on the first execution.

    `_cuda_backend` replaces torch.cuda for the GPU layer (asyncgraph.cuda.device.Backend,
    handed to the "cuda" device backend):
    tests run programs with CUDA nodes on a simulated GPU with it. `_passed`: the program's
    graph after the graph passes, and their counts, from the Executor a fast form is built
    for (runtime/build.py). Neither is part of the public API.
    """

    def __init__(
        self,
        program: ProgramLike,
        config: ExecutorConfig | None = None,
        *,
        kernel_factory: KernelFactory | None = None,
        _cuda_backend: object | None = None,
        _passed: tuple[Graph, PassCounts] | None = None,
    ) -> None:
        self.config = config if config is not None else ExecutorConfig()
        self.program: Program = to_program(program)
        built = build(
            self.program.graph, self.config,
            kernel_factory or KernelFactory(self.config, subgraph_executor), _cuda_backend,
            _passed,
        )
        self._passed = (built.passed, built.counts)  # what a fast form builds on
        self.graph: Graph = built.graph  # the executed graph (the program's keeps its own)
        self.kernels: list[OpKernel] = built.kernels
        self.plan: ExecutionPlan = built.plan
        counts = built.counts  # what the graph passes did (runtime/build.py: GRAPH_PASSES)
        self.recomposed, self.dropped_identities = counts.recomposed, counts.dropped_identities
        self.qkv_splits, self.lowered_linears = counts.qkv_splits, counts.lowered_linears
        self.weight_copies, self.fused_activations = counts.weight_copies, counts.fused_activations
        self._segments = built.segments  # backend -> its delegate nodes (runtime/delegates.py)
        self._delegates = built.delegates  # every delegate node's target: swaps, aclose
        self._folder: ConstantFolder | None = built.folder
        # The device side (runtime/device.py's DevicePlan), None for a CPU-only program.
        device = self._device = built.device
        # cuda/'s plans under their public names (docs/gpu.md), typed Any: the runtime does
        # not name cuda/'s types. The StreamPlan and the CudaRuntime (cuda/backend.py);
        self.stream_plan: Any = getattr(device, "stream_plan", None)
        self.cuda_runtime: Any = getattr(device, "runtime", None)
        # whether executions are captured as CUDA graphs, and why not (cuda/graphs.py);
        self.cuda_graph_plan: Any = getattr(device, "graph_plan", None)
        # otherwise, the segments captured and the nodes left out, with why (cuda/segments.py).
        self.cuda_segment_plan: Any = getattr(device, "segment_plan", None)
        self._adaptive = built.adaptive
        self._schedules = built.schedules
        # Fused units time and trace as one: profiled, traced and shuffled runs stay per node.
        self._fuse = not self.config.trace and self.config.ready_order_seed is None
        self._weights = self._with_folded(Weights(self.program.weights))
        self._validator = InputValidator(self.graph, self.config.max_unbounded_int)
        # the tracing instrument (runtime/instrument.py; tools/trace.py's TraceRecorder)
        self.recorder: Instrument | None = make_tracer(self.graph) if self.config.trace else None
        self._workers = WorkerPool(
            self.config.max_parallel_ops, inference_mode=self.config.inference_mode,
            pin=self.config.pin_workers,
            intra_op_threads=self.config.intra_op_threads_or_default,
            nice=self.config.worker_nice, idle=self.config.worker_idle,
            yield_s=self.config.worker_yield_s,
        )
        self._scheduler = Scheduler(
            self.graph, self.plan, self.config, self._workers, self.recorder
        )
        self._modes = ModeChooser(  # the one decision of how each execution runs
            self._scheduler.state, self.config, device=device is not None,
            captured=device is not None and device.captures_whole,
            traced=self.recorder is not None,
        )
        self._pool = FramePool(
            self._new_frame,
            self.config.max_concurrent_executions,
            self.config.min_frames,
            self.config.frame_cleanup_interval_s,
            max_waiters=self.config.max_frame_waiters,
        )
        sig = self.graph.signature
        self._user_outputs = [o.arg for o in sig.outputs if o.kind is OutputKind.USER_OUTPUT]
        # The outputs' frame slots when all are values (not constants): read without a test.
        self._output_slots = (
            [a.id for a in self._user_outputs]
            if all(isinstance(a, Ref) for a in self._user_outputs)
            else None
        )
        # A program returning one tensor: its single output is the result, no pytree needed.
        self._single_output = (
            sig.out_spec is not None and sig.out_spec.is_leaf() and len(self._user_outputs) == 1
        )
        self._validate = self.config.validate_inputs
        self._move_inputs = self.config.move_inputs_to_device
        self._mover = device.move_inputs if device is not None else move_inputs_to_device
        self._buffer_mutations = [
            (o.arg, o.target) for o in sig.outputs if o.kind is OutputKind.BUFFER_MUTATION
        ]
        user_paths = [s.target for s in sig.inputs if s.kind is InputKind.USER_INPUT]
        self._input_mutations = [
            (o.arg, user_paths.index(o.target))
            for o in sig.outputs
            if o.kind is OutputKind.USER_INPUT_MUTATION
        ]
        # the faster forms of the program, built off the loop (runtime/forms.py); `_run` is
        # `_execute` itself when there are none
        self._forms = self._fast_forms(kernel_factory is None)
        self._run = self._forms.run if self._forms is not None else self._execute
        # batching.py's make_batcher: None when off, or when an only_captured config finds
        # no whole-execution CUDA graphs or no batch dimension
        self._batcher = make_batcher(
            self.graph, self.config.batching, self._run,
            captured=self.config.cuda.graphs and device is not None,
            captures_whole=device is not None and device.captures_whole,
            inputs_out=self.cuda_graph_plan is not None and self.cuda_graph_plan.inputs_out,
        )
        self._ids = itertools.count(1)
        # Straight-line executions run without a frame where a frame would do nothing more:
        # straight.py's run_alone, `_run_alone`.
        self._may_run_alone = (
            self._fuse and self.recorder is None and device is None
            and self._output_slots is not None and not self.plan.token_slots
            and not self._buffer_mutations and not self._input_mutations
        )
        # Mode.DIRECT (runtime/direct.py): a program of one delegate call, called as such
        self._direct = DirectCall.of(
            self.graph, self.plan, [k.fn for k in self.kernels], self.config.inference_mode,
            weights=lambda: self._weights, adaptive=self._adaptive, schedules=self._schedules,
            modes=self._modes, state=self._scheduler.state, has_free=self._pool.has_free,
            workers=self._workers,
        ) if self._may_run_alone else None
        self._alone_frame = ExecutionFrame(self.plan, 0)  # Mode.FRAMELESS's, one at a time
        self._no_values = [None] * self.plan.num_values
        self._alone = 0
        self._loop: Loop | None = None  # the event loop's seam (backend.py), bound on first use
        self._native_loop: object = None  # its asyncio loop (or TrioLoop): the bound check
        self._cancelled_exc: type[BaseException] = asyncio.CancelledError  # the loop's
        self._closed = False
        self._started = 0
        self._ended = [0, 0, 0]  # executions by how they ended: _COMPLETED, _FAILED, _CANCELLED
        self._by_mode = [0] * len(Mode)  # executions by the mode they ran in
        self._callers: set[Caller] = set()  # what aclose(cancel=True) cancels
        registry.register(self)

    # -- executions --------------------------------------------------------------------------

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        """Run the program on `(args, kwargs)`; returns what `ep.module()(*args, **kwargs)` does."""
        native = self._native_loop  # the asyncio backend's shortcuts (backend.py)
        bound = runs_here(native)  # one test finds the task and keeps the loop bound
        caller = task_of(native) if bound else self._calling_task()
        if cancel_pending(caller):
            await anyio.lowlevel.checkpoint()  # delivers a pending cancellation: no frame taken
        if self._closed:
            self._check_open()
        validator = self._validator
        if validator.positional_leaves and not kwargs and len(args) == validator.count:
            flat = list(args)  # flatten's first case, without the call
        else:
            flat = validator.flatten(args, kwargs)
        inputs, signature = self._accept(flat, bound)
        if self._batcher is not None:
            outputs = await self._batcher.submit(inputs, signature)
        else:
            outputs = await self._run(inputs, flat, caller, signature)
        if self._single_output:
            return outputs[0]
        out_spec = self.graph.signature.out_spec
        return pytree.tree_unflatten(outputs, out_spec) if out_spec is not None else outputs

    async def execute_flat(self, inputs: Sequence[Any]) -> list[Any]:
        """Run the program on flat user inputs; returns the flat user outputs (nativert's path)."""
        caller = self._calling_task()
        if cancel_pending(caller):
            await anyio.lowlevel.checkpoint()
        self._check_open()
        flat = list(inputs)
        accepted, signature = self._accept(flat)
        if self._batcher is not None:
            return await self._batcher.submit(accepted, signature)
        return await self._run(accepted, flat, caller, signature)

    async def warm_up(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Capture ahead the CUDA graphs that executions like `execute(*args, **kwargs)` will
        replay, and return once they are captured: the first such execution replays, none
        pays for a capture or runs its warm-up (docs/gpu.md, "Capture ahead").

        Why: a service knows its shapes at start-up, and wants its first requests to replay
        rather than run `graph_warmup` executions uncaptured and wait for a capture (vLLM
        and TensorRT-LLM capture their batch sizes at start-up the same way). The captures
        run on a thread, never on the loop, and executions go on meanwhile on the stream
        path (`before_ready`), never waiting for them.

        What is captured: per input signature, as many graph instances as one may have
        (`max_concurrent_executions`, at most 8) and torch's capture streams allow (32 per
        device / the plan's streams, shared by every Executor of the process). With batching
        padding to buckets (`BatchingConfig.buckets`), every batch runs at a bucket's size,
        so one signature per bucket is captured, its inputs made from the example's by
        repeating its rows (an instance for each bucket before a second for any). The
        example's values do not matter, only their shapes, dtypes and devices. At most
        `MAX_CAPTURES` (8) signatures (ValueError past it: the first would be evicted).

        Returns, per signature, where its graphs stand (cuda/capture.py's SignatureCapture:
        "ready" with its instances, or "failed" with the capture's error, after which that
        signature runs on the stream path, or "uncaptured" with why, such as no capture
        stream free); `device_statistics().signatures` says the same at any time. [] when
        the Executor captures no whole executions (no CUDA nodes, `cuda.graphs` off, or a
        program that is not wholly capturable: `cuda_graph_plan.reason`). A weights swap
        later recaptures them (ahead with `CudaConfig.capture_ahead`, else by the first
        execution on the new weights); a cancelled call stops waiting, not the captures;
        `aclose` stops them. Raises what `execute` raises for inputs it refuses.
        """
        self._check_open()
        inputs, signature = self._accept(self._validator.flatten(args, kwargs))
        device = self._device
        if device is None or not device.captures_whole:
            return []
        examples: list[tuple[list[Any], Signature | None]] = [(inputs, signature)]
        layout = self._batcher.layout if self._batcher is not None else None
        if layout is not None and layout.buckets:  # every batch runs at a bucket's size
            examples = []
            for size in layout.buckets:
                bucket = [
                    x.index_select(0, torch.arange(size, device=x.device) % x.shape[0])
                    if batched and isinstance(x, torch.Tensor) and x.dim() and x.shape[0]
                    else x
                    for x, batched in zip(inputs, layout.batched, strict=True)
                ]
                checked = self._validator.check(bucket) if self._validate else None
                examples.append((bucket, checked))
        weights = self._weights
        template = weights.template(self.plan.weight_slots, self.plan.num_values)
        return await device.warm_up(examples, template, weights.version)

    def _calling_task(self) -> asyncio.Task[Any] | None:
        """The calling asyncio task; None without an asyncio loop (trio, backend.py)."""
        if runs_here(self._native_loop):
            return task_of(self._native_loop)  # the bound loop is the running one
        try:
            return asyncio.current_task()
        except RuntimeError:  # no asyncio loop: trio, which has no such task
            return None

    def _accept(
        self, flat: list[Any], bound: bool = False
    ) -> tuple[list[Any], Signature | None]:
        """Validate one request before it takes a frame or joins a batch; bind the loop
        (`bound`: the caller saw the bound loop run on this thread, the check `_bind_loop`
        would make first).

        Returns the inputs to run on (moved to their devices first when the config says so;
        the caller's own list gets user-input mutations) and their signature when validation
        computed one: adaptive placement finds its entry by it without a key of its own.
        """
        validator = self._validator
        if self._move_inputs and len(flat) == validator.count:
            flat = self._mover(flat, validator.specs)  # before the device check
        signature = None
        if self._validate:
            signature = validator.check(flat)
        elif len(flat) != validator.count:
            validator.check(flat)  # the count is always checked
        if not bound:
            self._bind_loop()
        return flat, signature

    async def _execute(
        self, flat: list[Any], caller_inputs: list[Any] | None = None,
        caller: Caller | None = None, signature: Signature | None = None, direct: bool = True,
    ) -> list[Any]:
        """One execution of validated inputs: take a frame, run, take the outputs. `caller`:
        the calling task, if known; `signature`: the inputs' (InputValidator.check), if made;
        `direct`: False when the caller found `_run_direct` declining this execution already."""
        if caller is None and self._loop is not None:
            scoped = self._loop.scope_caller()  # trio: no task to cancel, a cancel scope
            if scoped is not None:
                return await self._execute_in_scope(scoped, flat, caller_inputs, signature, direct)
            caller = asyncio.current_task()
        outputs = self._run_direct(flat, signature, caller) if direct else None
        if outputs is not None:  # Mode.DIRECT: the program's one call (or DIRECT_WORKER's)
            return outputs if isinstance(outputs, list) else await outputs
        frame = None  # none taken while one is free: the execution may need none
        if not (self._may_run_alone and self._pool.has_free()):
            frame = self._take_free_frame(caller) or await self._take_frame(caller)
        self._started += 1
        ended = _FAILED
        times: NodeTimes | None = None
        try:  # from here on a frame taken goes back to the pool on every path
            if self._device is not None and not self._device.admits():
                await self._device.admit()  # its fixed work takes the loop's slice
            placement, times, schedule = self._choose(flat, signature)
            if schedule is None:  # compiled on a thread (milliseconds on large graphs)
                if frame is None:
                    frame = await self._take_frame(caller)
                schedule = await self._schedules.aget(placement, self._fuse and times is None)
            mode, start = self._modes.choose(schedule, times, frame is None)
            if mode is _FRAMELESS:  # on the Executor's own frame, never one of the pool's
                outputs = self._run_alone(flat, schedule, start)
            else:
                self._by_mode[mode] += 1
                if frame is None:  # one was free, and no await since
                    frame = self._take_free_frame(caller)
                    assert frame is not None, "a frame said free was taken meanwhile"
                frame.load(self._weights_template(), flat, schedule, times, self._weights.version)
                if mode is _LINE_NOW:
                    self._scheduler.run_now(frame, start)
                elif mode is not _CAPTURED:
                    await self._scheduler.run(frame, mode)
                elif not await self._replayed(frame, flat, signature):
                    await self._scheduler.run(frame, Mode.DATAFLOW)
                outputs = self._take_outputs(frame, caller_inputs or flat)
            if times is not None and self._adaptive is not None:
                self._adaptive.finished(times)
            ended = _COMPLETED
        except self._cancelled_exc:
            ended = _CANCELLED
            raise
        finally:
            self._ended[ended] += 1
            if times is not None and ended != _COMPLETED and self._adaptive is not None:
                self._adaptive.abandoned(times)  # its place among the profiled ones freed
            if frame is not None:
                self._callers.discard(caller)  # type: ignore[arg-type]
                self._pool.release(frame)  # the scheduler returns only once the frame is idle
        return outputs

    async def _execute_in_scope(
        self, scoped: Any, flat: list[Any], caller_inputs: list[Any] | None,
        signature: Signature | None, direct: bool,
    ) -> list[Any]:
        """`_execute` in a cancel scope of its own, the caller trio's (backend.py): what
        aclose(cancel=True) cancels, where trio has no task to cancel."""
        with scoped.scope:
            return await self._execute(flat, caller_inputs, scoped, signature, direct=direct)
        raise ExecutorClosedError(  # the scope caught its own cancellation
            f"{self.program.name}: the execution was cancelled by aclose(cancel=True)"
        )

    async def _take_frame(self, caller: Caller | None) -> ExecutionFrame:
        """Wait for a frame (FIFO), which carries the id of the execution it will run; the
        caller is known to aclose(cancel=True) from now on."""
        execution = next(self._ids)
        if caller is not None:  # before the frame wait, so aclose(cancel=True) reaches waiters
            self._callers.add(caller)
        waited = time.perf_counter_ns() if self.recorder is not None else 0
        frame = None
        try:
            frame = await self._pool.acquire()
        finally:
            if frame is None:  # cancelled, or refused (too many waiters)
                self._callers.discard(caller)  # type: ignore[arg-type]
        if self.recorder is not None:
            self.recorder.phase(execution, "frame wait", waited, time.perf_counter_ns())
        frame.execution_id = execution
        return frame

    def _take_free_frame(self, caller: Caller | None) -> ExecutionFrame | None:
        """A free frame, taken without a wait (None: none is free, `_take_frame` waits)."""
        frame = self._pool.try_acquire()
        if frame is not None:
            if caller is not None:
                self._callers.add(caller)
            frame.execution_id = execution = next(self._ids)
            if self.recorder is not None:  # a trace shows every execution's wait, none too
                now = time.perf_counter_ns()
                self.recorder.phase(execution, "frame wait", now, now)
        return frame

    async def _replayed(
        self, frame: ExecutionFrame, flat: list[Any], signature: Signature | None
    ) -> bool:
        """Mode.CAPTURED: whether the device replayed (or captured) the execution whole;
        False while it warms up, or for a signature it cannot capture (the dataflow runs)."""
        graphs = frame.graphs
        replayed = graphs is not None and await graphs.run(
            frame, flat, signature, self._weights.version
        )
        if not replayed and type(flat) is BucketRows:  # the dataflow reads its bucket inputs
            flat.materialise()
        return replayed

    def _choose(self, flat: list[Any], signature: Signature | None) -> _Choice:
        """The placement for this execution, the node times to record (None unless it is
        profiled) and its schedule when one is built (None: `aget` builds it)."""
        adaptive = self._adaptive
        if adaptive is not None:
            inputs = flat if signature is None else None  # the signature finds the entry
            placement, times = adaptive.choose(inputs, self._scheduler.loaded, signature)
        else:
            placement, times = self.plan.placement, None
        return placement, times, self._schedules.cached(placement, self._fuse and times is None)

    def _run_direct(
        self, flat: list[Any], signature: Signature | None, caller: Caller | None = None,
    ) -> list[Any] | Awaitable[list[Any]] | None:
        """Mode.DIRECT: the one call, at once (runtime/direct.py), counted as executions are;
        or Mode.DIRECT_WORKER / DIRECT_NEXT: the awaitable of the call on a worker thread or
        in a later iteration's slice (for a known `caller`, which aclose(cancel=True) can
        reach); None when this execution runs none of these ways. Synchronous, so a fast
        form's routing (runtime/forms.py) calls it before it awaits the form's `_execute`: a
        coroutine less on a path of about 10 us."""
        direct = self._direct
        start = direct.start(signature) if direct is not None else None
        if direct is None or start is None:
            return None
        if start is ON_WORKER or start is ON_NEXT:
            if caller is None:
                return None
            if start is ON_WORKER:
                return self._run_held(_DIRECT_WORKER, direct.run_on_worker(flat), caller)
            return self._run_held(_DIRECT_NEXT, direct.run_next(flat, signature), caller)
        self._started += 1
        ended = _FAILED
        try:
            outputs = direct.run(flat, start)
            ended = _COMPLETED
        finally:
            self._ended[ended] += 1
        self._by_mode[_DIRECT] += 1
        return outputs

    async def _run_held(self, mode: Mode, call: Awaitable[list[Any]], caller: Caller,
                        ) -> list[Any]:
        """Mode.DIRECT_WORKER or DIRECT_NEXT: the one call awaited holding a frame of the
        pool (the pool bounds executions; the frame holds nothing: DirectCall carries the
        call). On workers, under 64 callers of the encoder's ONNX form, 13% more requests
        per second than the general path's LINE_WORKER, whose frame load, placement,
        schedule and units cost the loop's thread 15 us more per request
        (benchmarks/results/cpu/design_measurements.md#direct-calls-on-workers)."""
        frame = self._take_free_frame(caller)  # `start` saw one free, and no await since
        assert frame is not None, "a frame said free was taken meanwhile"
        self._started += 1
        self._by_mode[mode] += 1
        ended = _FAILED
        try:
            outputs = await call
            ended = _COMPLETED
        except self._cancelled_exc:
            ended = _CANCELLED
            raise
        finally:
            self._ended[ended] += 1
            self._callers.discard(caller)
            self._pool.release(frame)
        return outputs

    def _run_alone(self, flat: list[Any], schedule: Schedule, start: float) -> list[Any]:
        """Mode.FRAMELESS: run the straight line at once on the Executor's own frame, never
        one of the pool's (the pool's acquire and release, the frame's load, finish and clear
        are a fixed cost per execution, a fifth of a one-node graph's).

        Only where a frame would hold nothing more than the values (`_may_run_alone`: no
        GPU, trace, seeded order, mutation or effect token) and a frame of the pool is free,
        so the pool still bounds how many executions run; run synchronously, nothing
        interleaves with it: no cancellation, no other execution reading the values."""
        frame = self._alone_frame
        if frame.schedule is not schedule:  # mostly the same, execution after execution
            frame.use(schedule)
        outputs_at = self._output_slots
        assert outputs_at is not None
        values = frame.values
        try:
            self._scheduler.run_now(frame, start, self._weights_template(), flat)
            outputs = [values[slot] for slot in outputs_at]
        finally:
            values[:] = self._no_values  # nothing of it outlives the execution
            frame.stopped = False  # as a failure left it
        self._alone += 1
        return outputs

    def _take_outputs(self, frame: ExecutionFrame, flat: list[Any]) -> list[Any]:
        values = frame.values
        slots = self._output_slots
        if slots is not None:
            outputs = [values[slots[0]]] if len(slots) == 1 else [values[i] for i in slots]
        else:
            outputs = [values[a.id] if isinstance(a, Ref) else a for a in self._user_outputs]
        if frame.gpu is not None:  # the caller's stream will use them: see protect_outputs
            frame.gpu.protect_outputs(outputs)
        if self._buffer_mutations:
            updates = {str(name): values[a.id] for a, name in self._buffer_mutations}
            self._weights = self._weights.updated(updates)
        for arg, index in self._input_mutations:
            with torch.no_grad():
                flat[index].copy_(values[arg.id])
        return outputs

    def _new_frame(self, frame_id: int) -> ExecutionFrame:
        """A frame, with its GPU state (events made once, reused by its executions)."""
        device = self._device
        if device is None:
            return ExecutionFrame(self.plan, frame_id)
        gpu, captures = device.frame_state(self.plan.calls)
        return ExecutionFrame(self.plan, frame_id, gpu, captures)

    def _weights_template(self) -> list[Any]:
        """The weights an execution starting now runs on, noted for its task (weights_ran_on)."""
        weights = self._weights
        ran_on(weights.version)
        return weights.template(self.plan.weight_slots, self.plan.num_values)  # built once

    # -- weights -----------------------------------------------------------------------------

    def swap_weights(self, state_dict: Mapping[str, Any], *, strict: bool = False) -> int:
        """Replace parameters and buffers atomically; returns the new weights version.

        Executions already running finish on the old weights; later ones see the new ones.
        """
        self._check_open()
        weights = self._with_folded(self._weights.swapped(state_dict, strict=strict))
        _prepare_delegates(self._delegates, weights.tensors)  # e.g. AOTI's spare buffers
        self._weights = weights
        return self._weights.version

    async def aswap_weights(self, state_dict: Mapping[str, Any], *, strict: bool = False) -> int:
        """`swap_weights` with the constant folding on a worker thread; returns the new version.

        Folding recomputes every folded constant from the new weights (transposed and
        dequantised weights: as much work as those nodes of a call, often more); inline it holds
        the loop and every execution waits. Here executions go on with the old weights while a
        thread folds, then the new version replaces the old one on the loop, in one assignment:
        `prepare_weights`, then `commit_weights`. Swaps complete in call order, so versions
        follow the calls; a swap cancelled before it completes changes nothing. Errors are
        those of `swap_weights`, raised here.
        """
        self._check_open()
        folder = self._folder
        if not self._delegates and (folder is None or not len(folder)):  # nothing off the loop
            return self.swap_weights(state_dict, strict=strict)
        async with self._swap_lock():
            prepared = await self.prepare_weights(state_dict, strict=strict)
            while not self._folded_from_current(prepared):
                # a swap_weights call replaced weights that folding reads meanwhile: fold again
                prepared = await self.prepare_weights(state_dict, strict=strict)
            return self.commit_weights(prepared)

    async def prepare_weights(
        self, state_dict: Mapping[str, Any], *, strict: bool = False
    ) -> PreparedWeights:
        """The first half of `aswap_weights`: check `state_dict` as `swap_weights` does, let
        the delegates ready the new version (compiled segments' spare buffers, ONNX sessions)
        and fold its constants, on worker threads. Executions see none of it until
        `commit_weights`; one never committed is simply dropped. Not ordered with other swaps:
        `commit_weights` takes care of what changed meanwhile.
        """
        self._check_open()
        base = self._weights
        candidate = base.swapped(state_dict, strict=strict)  # checks names and shapes
        if self._delegates:  # off the loop
            await anyio.to_thread.run_sync(_prepare_delegates, self._delegates, candidate.tensors)
        folder = self._folder
        derived: dict[str, Any] | None = None
        if folder is not None and len(folder):
            derived = await anyio.to_thread.run_sync(folder, candidate.tensors)
            self._check_open()
        return PreparedWeights(self, dict(state_dict), strict, base, derived)

    def commit_weights(self, prepared: PreparedWeights) -> int:
        """The second half of `aswap_weights`: put a swap `prepare_weights` made in place, in
        one assignment on the loop, without awaiting; returns the new weights version. So a
        caller can commit several Executors' swaps, and whatever goes with them, in one step of
        the loop (model control's multi-version hot swap). Buffers that executions updated
        since the preparation are kept; if a `swap_weights` or another commit replaced weights
        that folding reads, the constants are folded again here, inline. Raises only
        ExecutorClosedError, or ValueError for another Executor's preparation.
        """
        if prepared.owner is not self:
            raise ValueError(
                f"{self.program.name}: these weights were prepared by {prepared.owner!r}, "
                f"not by this executor; prepare them with its own prepare_weights"
            )
        self._check_open()
        weights = self._weights.swapped(prepared.state_dict, strict=prepared.strict)
        if prepared.derived is not None and self._folded_from_current(prepared):
            weights = weights.with_derived(prepared.derived)
        else:
            weights = self._with_folded(weights)
        self._weights = weights
        return weights.version

    def _folded_from_current(self, prepared: PreparedWeights) -> bool:
        """Whether `prepared`'s constants were folded from the weights folding reads now."""
        folder = self._folder
        if prepared.derived is None or folder is None:
            return True  # nothing folded (a commit folds inline, if anything)
        return folder.reads_same(prepared.base.tensors, self._weights.tensors)

    _swap_lock_on_loop: anyio.Lock | None = None

    def _swap_lock(self) -> anyio.Lock:
        """The FIFO lock that orders aswap_weights calls (made on first use, on the loop)."""
        if self._swap_lock_on_loop is None:
            self._swap_lock_on_loop = anyio.Lock()
        return self._swap_lock_on_loop

    def _with_folded(self, weights: Weights) -> Weights:
        """`weights` with the folded constants computed from them (asyncgraph/passes/folding.py)."""
        folder = self._folder
        return weights.with_derived(folder(weights.tensors)) if folder is not None else weights

    @property
    def weights(self) -> Weights:
        return self._weights

    # -- delegates ---------------------------------------------------------------------------

    @property
    def segments(self) -> dict[str, list[str]]:
        """The delegate nodes each segment backend of `config.segments` made, by backend
        name ({"onnx": ["onnx_segment_0"]}; a backend that found no run: [])."""
        return {name: list(nodes) for name, nodes in self._segments.items()}

    @property
    def scripted(self) -> list[str]:
        """The scripted segments' delegate nodes: `segments["script"]`, or []."""
        return list(self._segments.get("script", ()))

    @property
    def onnx(self) -> list[str]:
        """The ONNX segments' delegate nodes: `segments["onnx"]`, or []."""
        return list(self._segments.get("onnx", ()))

    def delegate_statistics(self) -> dict[str, dict[str, Any]]:
        """Each delegate node's own statistics (runtime/delegates.py `Delegate.statistics`),
        by node name: what its backend ran and, where it says, which signatures it serves
        ("serves") and why."""
        return {getattr(d, "__name__", f"delegate_{i}"): d.statistics()
                for i, d in enumerate(self._delegates)}

    # -- lifecycle ---------------------------------------------------------------------------

    async def aclose(self, *, cancel: bool = False) -> None:
        """Stop taking executions, let those in flight finish (or cancel them), stop threads.

        Idempotent. With `cancel=True` executions in flight, those waiting for a frame and
        batched requests are cancelled instead; each still returns its frame only once its
        worker threads and GPU work are done, and aclose returns after that. What the caller
        sees: on asyncio its task is cancelled (CancelledError); on trio, where a cancellation
        belongs to a cancel scope and cannot be raised at will, each execution runs in a
        scope of its own that is cancelled, and the caller gets ExecutorClosedError naming
        aclose(cancel=True) (a caller whose own scope was cancelled too gets its cancellation).
        """
        if not self._closed:
            self._closed = True
            if cancel:
                for task in self._in_flight_tasks():
                    task.cancel()
        if self._batcher is not None:  # queued requests were accepted: they still run
            await self._batcher.aclose(cancel=cancel)
        if self._forms is not None:  # a build in progress ends, then every form closes
            await self._forms.aclose(cancel=cancel)
        await self._pool.wait_idle()
        if self._device is not None:  # every frame is idle: free their graphs and pools; the
            await self._device.stop()  # captures ahead (warm_up) end first
            self._device.close()  # host-wait thread ends once nothing waits
        self._pool.close()
        for delegate in self._delegates:  # their threads (tracers, builders) end
            await delegate.aclose()
        for kernel in self.kernels:  # subgraph kernels own executors of their own
            if isinstance(kernel.fn, SubgraphKernel):
                await kernel.fn.aclose()
        await self._workers.aclose()
        # A closed Executor that its owner still references must not keep its event loop
        # (and everything the loop references) alive after the loop is closed.
        self._loop = self._scheduler.loop = self._swap_lock_on_loop = None
        self._native_loop = None
        if self._batcher is not None:
            self._batcher.loop = None

    async def __aenter__(self) -> Executor:
        self._check_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def statistics(self) -> ExecutorStatistics:
        frames = self._pool.statistics()
        return ExecutorStatistics(
            started=self._started,
            completed=self._ended[_COMPLETED],
            failed=self._ended[_FAILED],
            cancelled=self._ended[_CANCELLED],
            in_flight=frames.in_use,
            frames=frames,
            workers=self._workers.statistics(),
            weights_version=self._weights.version,
            nodes=self.plan.num_nodes,
            folded_nodes=len(self._folder) if self._folder is not None else 0,
            closed=self._closed,
            schedules=self._schedules.statistics(),
            worker_executions=self._scheduler.worker_executions,
            frameless_executions=self._alone,
            modes={mode.name: self._alone if mode is _FRAMELESS else self._by_mode[mode]
                   for mode in Mode},
            validated_signatures=self._validator.passed_signatures,
            forms=self._forms.statistics() if self._forms is not None else None,
        )

    @property
    def batching(self) -> BatchingConfig | None:
        """The batching this Executor does (None: every request its own execution): the
        config's, unless that only applies where whole executions replay as CUDA graphs and
        they do not here (`BatchingConfig.only_captured`, the default)."""
        return self._batcher.config if self._batcher is not None else None

    def batching_statistics(self) -> BatcherStatistics | None:
        """Requests and batches so far (None when batching is off)."""
        return self._batcher.statistics() if self._batcher is not None else None

    def placements(self) -> dict[str, Placement]:
        """Where each node runs (after adaptive placement, the latest choice), by node name."""
        current = self._adaptive.current if self._adaptive is not None else self.plan.placement
        return {n.name: current[n.index] for n in self.graph.nodes}

    def device_statistics(self) -> Any:
        """What the device side did, as its backend counts it (runtime/device.py's
        DevicePlan.statistics; cuda/: captures, replays and fallbacks of CUDA graphs, a
        CudaGraphStatistics); None for a program without device nodes."""
        return self._device.statistics() if self._device is not None else None

    def cuda_graph_statistics(self) -> Any:
        """Captures, replays and fallbacks of CUDA graphs (cuda/capture.py's
        CudaGraphStatistics; None without CUDA nodes): `device_statistics()` under its
        older name."""
        return self.device_statistics()

    def placement_statistics(self) -> PlacementStatistics | None:
        """What adaptive placement has profiled and decided (None when it is off)."""
        return self._adaptive.statistics() if self._adaptive is not None else None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Executor {self.program.name}: {self.plan.num_nodes} nodes, {state}>"

    # -- fast forms (runtime/forms.py) ----------------------------------------------------

    def _fast_forms(self, default_kernels: bool) -> FastForms | None:
        """The program's fast forms, where `fast_paths` applies: no segments asked for, a
        CPU program run untraced in graph order with the default kernels, long enough for a
        segment, writing no buffer, and a fast-form backend that can run here.

        A program that writes a buffer makes a new weights version with every execution,
        and a form serves only the version it was built on: it would be built again and
        again and never serve (and a form would hold buffers of its own)."""
        config = self.config
        if not (config.fast_paths and not config.segments and default_kernels
                and self._device is None and self.recorder is None
                and config.ready_order_seed is None and not self._buffer_mutations
                and len(self.graph.nodes) >= MIN_FORM_NODES):
            return None
        backends = fast_form_backends()
        if not backends:
            return None
        registered = [segment_backend(backend) for backend in backends]
        for backend in registered:  # its imports here, at start-up, not on the build thread
            backend.load()  # while the loop serves (extensions hold the GIL)
        return FastForms(backends, self._build_form, self._execute,
                         lambda: self._weights.version,
                         verdicts=FormVerdicts(self.graph.described(), backends, THREAD_COUNTS),
                         batched=requested_batching(config) is not None,
                         additional=[b.name for b in registered if b.form_program],
                         thread_counts={b.name: b.form_threads for b in registered
                                        if b.form_threads})

    def _build_form(self, backend: str, threads: int) -> Executor:
        """The program with `backend`'s segments, their sessions on `threads` intra-op
        threads, on the current weights (build thread); or the program of its own that the
        backend makes from it (`SegmentBackend.form_program`: an AOTInductor package).

        A form that is one delegate call takes ONE_CALL_FRAMES times the frames: its
        executions run whole on the workers, and one that waits in the workers' queue holds
        only its inputs, while one that waits for a frame costs the loop a task wake more
        (tiny BERT, 64 callers: 80 us of loop CPU per execution with 8 frames, 51-64 with
        64; throughput 0.91-0.93x ONNX Runtime via to_thread against 1.03-1.11x)."""
        program = self.program  # weights read after FastForms noted their version: a swap
        source = Program(  # in between gives a form labelled older than it is, never served
            program.graph, dict(self._weights.tensors), f"{program.name} [{backend}]",
            program.reference, program.exported)
        config = dataclasses.replace(self.config, segments=(backend,), fast_paths=False,
                                     batching=None, intra_op_threads=threads)
        own = segment_backend(backend).form_program
        if own is not None:
            form = Executor(own(source, threads, config.max_parallel_ops),
                            dataclasses.replace(config, segments=()))
        else:  # the passes do not depend on the fields changed here
            form = Executor(source, config, _passed=self._passed)
        if form._one_delegate_call():
            form._pool.widen(self.config.max_concurrent_executions * ONE_CALL_FRAMES)
        return form

    def _one_delegate_call(self) -> bool:
        """Whether the graph is one delegate node and the getitems taking its outputs apart:
        its frame holds only an execution's inputs and outputs, never an intermediate."""
        calls = [n for n, k in zip(self.graph.nodes, self.kernels, strict=True)
                 if isinstance(k.fn, Delegate)]
        return len(calls) == 1 and all(
            n is calls[0] or n.target is operator.getitem for n in self.graph.nodes)

    def prepare_sessions(self) -> None:
        """Start each delegate's work for the current weights now (ONNX sessions): a fast
        form just built is about to serve, so its first calls should not wait for them."""
        _prepare_delegates(self._delegates, self._weights.tensors)

    @property
    def has_delegates(self) -> bool:
        """Whether any node runs as a delegate (a segment backend replaced a run)."""
        return bool(self._delegates)

    @property
    def delegates_idle(self) -> bool:
        """Whether no delegate is still building or checking (sessions, first calls)."""
        return all(getattr(d, "wait_idle", _idle)(0) for d in self._delegates)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorClosedError(
                f"{self.program.name}: the executor is closed; create a new one"
            )

    def _bind_loop(self) -> None:
        """Bind the Executor to the running event loop on first use, through its seam
        (backend.py: asyncio's own methods, or trio's); later calls check it is the same."""
        if runs_here(self._native_loop):
            return
        try:
            native = asyncio.get_running_loop()
        except RuntimeError:
            native = None  # trio, or no loop: current_loop() tells
        if native is not None and native is self._native_loop:
            return
        loop = current_loop()
        if self._loop is None:
            self._loop, self._native_loop = loop, loop.native
            self._cancelled_exc = loop.cancelled_exc
            threads = self.config.loop_intra_op_threads  # inline nodes run on this thread
            if threads is not None and torch.get_num_threads() > threads:
                torch.set_num_threads(threads)
            self._scheduler.loop = loop
            if self._batcher is not None:
                self._batcher.loop = loop
        elif self._native_loop is not loop.native:
            raise RuntimeError(
                "this Executor is bound to another event loop; create one Executor per loop"
            )

    def _in_flight_tasks(self) -> list[Caller]:
        return [t for t in self._callers if not t.done()]


def subgraph_config(config: KernelConfig | None) -> ExecutorConfig:
    """The configuration of an inner executor: the outer one, without re-validating inputs."""
    assert config is None or isinstance(config, ExecutorConfig)
    base = config if config is not None else ExecutorConfig()
    return dataclasses.replace(base, validate_inputs=False, trace=False)


def subgraph_executor(program: Program, config: KernelConfig | None) -> Executor:
    """The executor of a control-flow subgraph (kernels/control_flow.py), made with the outer
    executor's configuration (`subgraph_config`): the kernels get this from the runtime
    instead of importing the executor."""
    inner = subgraph_config(config)
    return Executor(program, inner, kernel_factory=KernelFactory(inner, subgraph_executor))


default_inner_executor(subgraph_executor)
device_dispatch_keys(dispatch_keys)  # kernels of a registered device type run there


def _prepare_delegates(delegates: Sequence[Delegate], tensors: Mapping[str, Any]) -> None:
    """Each delegate readies a new weights version before executions use it (runtime/
    delegates.py): compiled segments load it into a spare AOTI constant buffer, so a swap never
    recompiles them; ONNX segments start building its session."""
    for delegate in delegates:
        delegate.prepare_weights(tensors)
