"""ExecutorConfig: every knob of an Executor, frozen, with documented defaults.

Mirrors nativert's ExecutorConfig where it fits (validate_inputs, free_values_after_use,
max_parallel_ops, max_concurrent_executions, frame cleanup), in snake_case.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

#: The defaults of the two queue bounds: far above any burst a test, benchmark or the server
#: (whose admission gate holds frames x max_batch_size requests) sends, yet a bound on the
#: memory a flood of callers can pin (each waiting call holds its inputs).
DEFAULT_MAX_FRAME_WAITERS = 4096
DEFAULT_MAX_QUEUED_REQUESTS = 4096


def _default_parallel_ops() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def fast_paths_default() -> bool:
    """`ExecutorConfig.fast_paths`'s default: on, unless the environment's
    ASYNCGRAPH_FAST_PATHS is 0, false, off or no (a whole service, or a test run)."""
    value = os.environ.get("ASYNCGRAPH_FAST_PATHS", "1").strip().lower()
    return value not in {"0", "false", "off", "no"}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


BoundKind = Literal[">=", ">"]
"""How a Range bounds its field from below: at least (">=") or above (">") the bound."""

# The comparison that finds a value out of range, per bound: the one the hand-written checks
# made (`value < 1`), so a NaN passes and a value of the wrong type raises the same TypeError.
_OUT_OF_RANGE: dict[BoundKind, Callable[[Any, Any], bool]] = {">=": operator.lt, ">": operator.le}


@dataclass(frozen=True, slots=True)
class Range:
    """A plain range check of one field: `name` must be `op` (">=" or ">") `bound`, or None
    where `or_none`; `why`, when given, follows the bound in the message in parentheses.

    A config's checks are a table of these (and of functions for the rules that are not a
    plain range), run in order by `check`, so a field's bound is one line and every message
    has the same form: "max_batch_size must be >= 1, got 0".
    """

    name: str
    op: BoundKind
    bound: int
    or_none: bool = False
    why: str = ""

    def __call__(self, config: Any) -> None:
        value = getattr(config, self.name)
        if value is None and self.or_none:
            return
        if _OUT_OF_RANGE[self.op](value, self.bound):
            raise ValueError(self.message(value))

    def message(self, value: Any) -> str:
        """The ValueError's text for `value`, out of this range."""
        none = " or None" if self.or_none else ""
        why = f" ({self.why})" if self.why else ""
        return f"{self.name} must be {self.op} {self.bound}{none}{why}, got {value}"


Rule = Callable[[Any], None]
"""One check of a config: raises ValueError when the config breaks it."""


def check(config: Any, rules: tuple[Rule, ...]) -> None:
    """Run `rules` on `config` in order: the first broken one raises."""
    for rule in rules:
        rule(config)


def _buckets_increasing_within_max(config: BatchingConfig) -> None:
    """buckets, when given, rise strictly from 1 up to max_batch_size at most."""
    buckets = config.buckets
    if buckets is None:
        return
    ordered = all(a < b for a, b in itertools.pairwise(buckets))
    if not ordered or any(not isinstance(b, int) or b < 1 for b in buckets) or (
        buckets and buckets[-1] > config.max_batch_size
    ):
        raise ValueError(
            "buckets must be strictly increasing batch sizes from 1 to max_batch_size "
            f"({config.max_batch_size}), got {buckets!r}"
        )


#: BatchingConfig's checks, in the order they run.
BATCHING_RULES: tuple[Rule, ...] = (
    Range("max_batch_size", ">=", 1),
    Range("max_batch_bytes", ">=", 1, or_none=True, why="bytes of a batch's batched inputs"),
    Range("max_delay_s", ">=", 0),
    Range("max_concurrent_batches", ">=", 1),
    Range("max_queued_requests", ">=", 1),
    _buckets_increasing_within_max,
)


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """Dynamic batching (asyncgraph/runtime/batching.py): concurrent requests run as one execution.

    Attributes:
        max_batch_size: rows per execution; a request with more rows runs alone.
        max_batch_bytes: bytes of the batched inputs per execution (the requests' rows, the
            padding to a bucket left out), None for no limit: a batch stops growing before
            it passes this or max_batch_size, whichever comes first; a request larger than
            this alone runs alone. For models whose requests differ in size (long and short
            sequences) a row count bounds memory badly.
        max_delay_s: how long a batch that is not full may wait for more requests; a batch
            that fills meanwhile leaves at once. 0 takes what has queued by the end of the
            loop iteration: no added latency when idle.
        max_concurrent_batches: batches running at once; the next batch forms from what
            queues meanwhile, so batches grow with load. Batches that take milliseconds on
            worker threads (an ONNX or compiled segment) keep the workers busier with more in
            flight than workers: while the loop answers one batch's callers and takes their
            next requests, a worker runs a queued batch. Measured on tiny BERT's ONNX
            segment; batches of microseconds (the MLP) did better fewer and larger
            (benchmarks/results/cpu/design_measurements.md#batches-in-flight).
        retry_alone: when a batch of several requests fails, run each alone so a bad request
            fails alone and the others succeed.
        max_queued_requests: requests that may wait in the batcher's queue (4096); the next
            caller gets OverloadedError at once, so a flood of callers cannot pin unbounded
            memory. Raise it for bursts larger than that.
        buckets: batch sizes a batch is padded up to (the next one at or above its rows;
            past the largest, no padding), as GPU serving engines do, so a few CUDA graphs
            serve every size instead of one capture per exact size. None: vLLM's list when
            the Executor captures CUDA graphs (1, 2, 4, then multiples of 8 up to
            max_batch_size, thinned to at most `batching.MAX_DEFAULT_BUCKETS` sizes so that
            every bucket keeps its captures: `default_buckets`), no padding otherwise (on a
            CPU padding only adds work); (): never pad. A padded batch's rows are copied
            into a bucket-sized input kept per bucket and batch key (no concatenation, no
            thread).
        only_captured: batch only where it pays without being asked: on an Executor that
            replays whole executions as CUDA graphs (`CudaConfig(graphs=True)`, a program
            whose nodes can all be captured) of a program with a dynamic batch dimension 0
            (`batch_layout` accepts it); anywhere else (a CPU program, an uncaptured GPU one,
            no batch dimension) every request runs alone, silently, where a plain
            BatchingConfig would raise BatchingError. The form a default that batches CUDA
            graphs can take without touching CPU programs; rows must still be independent.
    """

    max_batch_size: int = 32
    max_delay_s: float = 0.0
    max_concurrent_batches: int = 2
    retry_alone: bool = True
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    buckets: tuple[int, ...] | None = None
    max_batch_bytes: int | None = None
    only_captured: bool = False

    def __post_init__(self) -> None:
        check(self, BATCHING_RULES)


#: ExecutorConfig's default batching: on only where whole executions replay as CUDA graphs.
CAPTURED_BATCHING = BatchingConfig(only_captured=True)


def requested_batching(config: ExecutorConfig) -> BatchingConfig | None:
    """The batching `config` asks for whatever the program, before an Executor is made: its
    BatchingConfig, unless that only applies to captured CUDA graphs (then the Executor
    decides: `Executor.batching`)."""
    batching = config.batching
    return None if batching is None or batching.only_captured else batching


#: CudaConfig's checks, in the order they run.
CUDA_RULES: tuple[Rule, ...] = (
    Range("streams", ">=", 1, or_none=True, why="CUDA streams per device for one execution"),
    Range("graph_warmup", ">=", 0, why="executions of a signature before its capture"),
    Range("max_captured_signatures", ">=", 1, or_none=True,
          why="input signatures whose whole-execution graphs an Executor keeps"),
)


@dataclass(frozen=True, slots=True)
class CudaConfig:
    """How an Executor runs a program's CUDA nodes (asyncgraph/cuda/, docs/gpu.md):
    `ExecutorConfig(cuda=CudaConfig(...))`. Unused by programs without CUDA nodes.

    Attributes:
        streams: CUDA streams per device that one execution spreads its CUDA nodes over
            (docs/gpu.md): independent branches on different streams can overlap on the GPU;
            1 runs every CUDA node of an execution in order on one stream. None (the
            default) lets the stream plan choose (cuda/streams.py's `choose_streams`): 1,
            unless independent branches carry work worth a stream of their own, then up to
            4. Why not always 4: uncaptured, the host enqueues a node in about 10 us, so small
            kernels cannot overlap, and on an H200 the wide MLP ran 0.89x as fast on 4
            streams as on 1; inside CUDA graphs the same MLP ran 2.09x as fast on 4, so
            captured plans count smaller branches. `Executor.stream_plan.stream_choice` says
            what was chosen and why. Concurrent executions get stream sets of their own, up
            to `max_concurrent_executions` sets.
        graphs: capture whole executions of a GPU program as CUDA graphs and replay them
            (docs/gpu.md, asyncgraph/cuda/graphs.py): acts only on programs whose nodes can
            all be captured (CUDA aten ops without host syncs; `Executor.cuda_graph_plan` says
            why not otherwise). Per input signature, after `graph_warmup` executions,
            a few graph instances that executions lease (cuda/instances.py). Outputs are
            copies, never the graph's static memory. Off by default
            until the GPU test suite passes on a real GPU with graphs faster than the stream
            path (docs/gpu.md: what has run on which GPU); the CUDA graphs of segments
            (cuda/segments.py) follow the same switch.
        graph_warmup: executions of an input signature, on the stream path,
            before the next one is captured (lazy initialisation, cuBLAS workspaces). A
            capture ahead runs its warm-up executions itself, on its thread.
        capture_ahead: capture off the serving path (cuda/graphs.py's CaptureAhead). The
            first execution of a signature, and one that finds every instance of it busy
            while it may have more, queue the capture of an instance on the Executor's
            capture-ahead thread (its `graph_warmup` executions first, there) and run on the
            stream path; executions replay once it is ready, never waiting for a capture.
            A weights swap recaptures there too. `Executor.warm_up(example)` captures a
            signature's instances ahead whatever this says, and is what a service with
            known shapes wants at start-up (as vLLM captures its batch sizes): its first
            requests then replay. Off by default: without it a capture is the execution
            that needs it (on a worker thread, never on the loop), which returns that
            execution's result from the capture's first replay and runs no execution more
            than serving does; with it, a signature costs up to `graph_warmup` + 1 extra
            uncaptured runs on the thread, and its early executions run uncaptured. Turn it
            on where shapes arrive unannounced and a request must never wait for a capture.
        max_captured_signatures: input signatures whose whole-execution graphs an Executor
            keeps, the least recently used evicted past it (its graphs freed, recaptured if
            it comes back). None (the default): `MAX_CAPTURES` (8), or, with batching into
            buckets, two batch keys' worth of them (`2 x` the buckets): batches of two input
            shapes past dim 0 (two sequence lengths, say) padded to 7 buckets are 14
            signatures, which 8 would evict in turn under load. Each kept signature holds its
            graph instances and their memory pools on the GPU.
    """

    streams: int | None = None
    graphs: bool = False
    graph_warmup: int = 2
    capture_ahead: bool = False
    max_captured_signatures: int | None = None

    def __post_init__(self) -> None:
        check(self, CUDA_RULES)


def _min_frames_within_executions(config: ExecutorConfig) -> None:
    """min_frames lies between 0 and max_concurrent_executions (a rule over two fields)."""
    if not 0 <= config.min_frames <= config.max_concurrent_executions:
        raise ValueError(
            "min_frames must be between 0 and max_concurrent_executions "
            f"({config.max_concurrent_executions}), got {config.min_frames}"
        )


def _segments_name_backends(config: ExecutorConfig) -> None:
    """segments is a tuple of distinct backend names (a bare string would be its letters);
    whether each is registered is the builder's check (runtime/delegates.py), which runs
    after every layer has registered its backends."""
    segments = config.segments
    if not isinstance(segments, tuple) or not all(isinstance(n, str) and n for n in segments):
        raise ValueError(
            f"segments must be a tuple of segment backend names, e.g. ('onnx',), got {segments!r}"
        )
    if len(set(segments)) != len(segments):
        raise ValueError(f"segments must name each backend once, got {segments!r}")


# How a deprecated keyword argument is rewritten: (the constructor's other keyword arguments,
# its name, its value); it warns, naming the spelling that replaced it, then rewrites that.
Rewrite = Callable[[dict[str, Any], str, Any], None]


def _warn_deprecated(name: str, value: Any, instead: str) -> None:
    warnings.warn(
        f"ExecutorConfig({name}={value!r}) is deprecated: use {instead}",
        DeprecationWarning, stacklevel=4,  # the caller of ExecutorConfig(...)
    )


def _segment_flag(backend: str) -> Rewrite:
    """A flag that meant segments=(backend,): True adds the backend (once); False, the
    default, means nothing and warns of nothing."""

    def rewrite(kwargs: dict[str, Any], name: str, on: Any) -> None:
        if not on:
            return
        _warn_deprecated(name, on, f"segments=({backend!r},)")
        segments = kwargs.get("segments", ())
        if isinstance(segments, tuple | list) and backend not in segments:
            kwargs["segments"] = (*segments, backend)

    return rewrite


def _cuda_field(cuda_field: str) -> Rewrite:
    """A flat `cuda_*` field that is now CudaConfig's `cuda_field`: set in `cuda` (the one
    given, else the defaults), which checks it."""

    def rewrite(kwargs: dict[str, Any], name: str, value: Any) -> None:
        _warn_deprecated(name, value, f"cuda=CudaConfig({cuda_field}={value!r})")
        cuda = kwargs.get("cuda", CudaConfig())
        kwargs["cuda"] = dataclasses.replace(cuda, **{cuda_field: value})

    return rewrite


#: The keyword arguments ExecutorConfig still takes for one release, each rewritten into the
#: spelling that replaced it, in this order (the segment flags': the order the builder ran
#: their backends in).
DEPRECATED_KEYWORDS: dict[str, Rewrite] = {
    "script_segments": _segment_flag("script"),
    "onnx_segments": _segment_flag("onnx"),
    "cuda_streams": _cuda_field("streams"),
    "cuda_graphs": _cuda_field("graphs"),
    "cuda_graph_warmup": _cuda_field("graph_warmup"),
}


#: ExecutorConfig's checks, in the order they run.
EXECUTOR_RULES: tuple[Rule, ...] = (
    Range("max_parallel_ops", ">=", 1),
    Range("intra_op_threads", ">=", 1, or_none=True, why="CPUs / max_parallel_ops"),
    Range("loop_intra_op_threads", ">=", 1, or_none=True),
    Range("worker_nice", ">=", 0, why="workers can only step back; 19 is the lowest priority"),
    Range("worker_yield_s", ">=", 0, why="0 never yields"),
    Range("max_concurrent_executions", ">=", 1),
    Range("max_frame_waiters", ">=", 0),
    _min_frames_within_executions,
    Range("frame_cleanup_interval_s", ">=", 0),
    Range("loop_slice_s", ">", 0),
    Range("profile_executions", ">=", 1),
    Range("placement_recheck_after", ">=", 0),
    Range("heavy_node_us", ">=", 0),
    Range("loaded_heavy_node_us", ">=", 0),
    Range("worker_execution_node_us", ">=", 0, or_none=True),
    Range("max_fused_nodes", ">=", 1),
    Range("heavy_op_flops", ">=", 0),
    _segments_name_backends,
)


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    """How an Executor runs its graph.

    Attributes:
        validate_inputs: check structure, dtype, device and every dimension of the inputs
            against the signature before a frame is taken.
        free_values_after_use: drop each intermediate as soon as its last user has run, so a
            long chain keeps only a couple of intermediates alive.
        max_parallel_ops: worker threads that run compute-heavy CPU kernels; 1 runs at most one
            heavy kernel at a time (the serial executor).
        intra_op_threads: torch's intra-op thread count (the OpenMP/MKL team one kernel may
            split over) in each worker thread. None (the default) takes the usable CPUs
            divided by `max_parallel_ops`, at least 1, and no more than torch's count in the
            thread that makes the executor (so a lower torch.set_num_threads or
            OMP_NUM_THREADS stands): the workers already run kernels side by side, and a team
            per worker on top oversubscribes the cores (2 cores, 2 workers: `asyncgraph demo`
            ran at 389-591 exec/s with torch's default of 2, 919-1,147 with
            OMP_NUM_THREADS=1). `intra_op_threads_or_default` is the resolved count, set on
            the worker threads the executor owns (the loop's thread: `loop_intra_op_threads`).
        loop_intra_op_threads: torch's intra-op thread count on the thread that runs the
            event loop, where inline nodes run: set when the executor binds to the loop, and
            only lowered, never raised (a lower count the process chose stands); None leaves
            the thread as it is. Inline kernels are small by construction (below
            `heavy_op_flops` / `heavy_node_us`), and an OpenMP team per inline node costs
            more than it splits: with torch's default of 2 on 2 cores, tiny BERT at batch 1
            took 1.35-3.0x its time at 1, and 64 unbatched callers got 0.60-0.77x the
            throughput (benchmarks/thread_policy.py, five runs); batched runs, which go whole
            to workers, were the same either way. Once set, torch keeps the count for the
            thread (and starts threads made later at it); the `asyncgraph` commands set the
            same from `--threads` (asyncgraph/cli/options.py). An event loop on a thread
            other than the main one wants it too: with torch's default of 2 on 2 cores, once
            the main thread had used an OpenMP team, a loop on another thread ran a 256-wide
            MLP at 2.0 ms per execution against 0.10 ms (most likely libgomp's spin-wait).
        pin_workers: pin each worker thread to a CPU of its own (of those the process may use,
            spread over every pinned pool of the process; Linux, ignored elsewhere). For a
            machine the service has to itself: the kernel may wake two workers onto one core
            and leave them there for milliseconds (2 cores, 16 matmul chains: 1.82-1.89x over
            serial pinned against 1.66-1.89x not); with other busy processes a pinned thread
            cannot move away from them.
        worker_idle: the worker threads run under Linux's SCHED_IDLE policy, for a machine
            the service has to itself: whenever another thread wakes (the event loop's first
            of all), it takes a worker's core at once. With workers on every core at the
            loop's priority or a few nice levels below it, the loop woken by a finished
            execution waits for a core (Linux 6.18's EEVDF scheduler lets a running thread
            finish its slice). 64 callers of tiny BERT in ONNX segments on 2 cores, bursts of
            64: the loop's thread waited 2-6 ms per 11 ms burst for a core with workers at
            nice 5, 10 or 19 alike, and 0-0.7 ms with them idle; the loop's lag p99 per burst
            fell from 1.3-5.9 ms to 0.3-2.9 ms. But idle workers get a core only when no
            other thread of any process wants it: with two CPU-bound processes on the same 2
            cores, a burst took 3.6-7.9 s against 27-51 ms at nice 5
            (benchmarks/results/cpu/design_measurements.md#worker-idle). Hence off by
            default. Threads the library starts from a worker (tracer, ONNX builder, host
            waiter, a nested pool) start at the loop's priority (runtime/threads.py); threads
            a kernel starts itself, and torch's inter-op pool if a kernel on a worker makes
            it, keep the worker's.
        worker_nice: unless `worker_idle` (or where SCHED_IDLE cannot be set), how much each
            worker thread raises its own nice value (Linux; 0 leaves them as they are), so
            that other processes at the default priority come first and the loop's thread gets
            a larger share of a core than a worker.
            At 5, against 0, the loop woke sooner and batched callers ran slightly more
            requests/s; unbatched and plain-graph callers ran the same either way
            (benchmarks/results/cpu/design_measurements.md#worker-nice).
        worker_yield_s: a worker thread that has run items for this long since it last
            stepped aside calls `sched_yield` after its item (POSIX; 0 never does), so the
            loop's thread, woken while every core runs a worker, gets a core within about
            this long plus one item instead of a scheduler slice. Under 64 unbatched callers
            of tiny BERT or the encoder on 2 cores, 2 ms brought the loop's lag p99
            from up to 4.5 ms to at most 1.7 ms and its maximum from up to 11 ms to at most 6
            ms, for 4-8% fewer requests/s; 0 is for throughput alone
            (benchmarks/results/cpu/design_measurements.md#workers-that-yield).
        max_concurrent_executions: execution frames; callers beyond this await a free frame,
            first come first served.
        max_frame_waiters: executions that may await a frame (4096); the next gets
            OverloadedError at once, so a flood of callers cannot pin unbounded memory.
            Raise it for bursts larger than that; 0 refuses any call that finds no frame free.
        min_frames: frames kept alive by the idle cleanup.
        frame_cleanup_interval_s: frames idle longer than this are freed down to min_frames;
            0 disables the cleanup.
        max_unbounded_int: the largest value accepted for an int input whose symbol has no
            upper bound (such ints size allocations inside kernels).
        inference_mode: run kernels under torch.inference_mode.
        loop_slice_s: the time per event-loop iteration that inline kernels may take, shared
            by all executions on the loop (asyncgraph/runtime/loop_budget.py), so timers and I/O
            keep their turn however many callers there are. On asyncio's own loops a spent
            slice is extended while nothing else waits (no ready callback, timer due or I/O).
        heavy_op_flops: estimated work (multiply-adds or elements) above which a CPU kernel runs
            on a worker thread instead of inline on the loop.
        adaptive_placement: time every node during the first `profile_executions` executions
            of each input-shape signature, then run nodes taking at least `heavy_node_us` on
            workers where they can overlap other heavy work (parallel branches, or other
            executions while the loop is busy) and the rest inline
            (asyncgraph/runtime/placement.py).
        profile_executions: profiled executions per input-shape signature.
        placement_recheck_after: executions of a signature, after its placement is decided,
            before it is profiled again (with that placement) and decided again from the best
            times of all rounds; two more rechecks follow, after twice and four times as many
            executions: the first round may still be warming up (an AOTInductor segment near
            the loop slice landed on a worker, paying a thread hop per call). 0: decide once.
        heavy_node_us: measured (best) time from which a CPU node is worth a worker thread.
        loaded_heavy_node_us: the same bar while executions overlap and the loop is busy
            (the placement that sends heavy nodes to workers to overlap other executions).
            Higher, because there a worker needs the GIL, which the busy loop holds, to
            start and finish each node: 64 callers of an encoder whose ~60 us matmuls went to
            workers got 25-30% less throughput than with them inline; ~1 ms matmuls (32-row
            batches) gain 3-9% on workers.
        worker_execution_node_us: the measured time per node from which an execution that
            overlaps others and takes at least the loop's slice runs its whole straight line
            (an all-inline schedule) on a worker thread: its kernels release the GIL, so two
            such executions (two 32-row batches) use two cores where the loop gives them one.
            The per-node bar keeps graphs of small ops on the loop, where most of a node's
            time is Python dispatch that holds the GIL on any thread. None: never.
        fast_bindings: call aten ops through torch's generated Python bindings where one
            reaches exactly the same overload (kernels/fast_bindings.py): 0.3-1.5 us less per
            call than the OpOverload. Tensor subclasses' __torch_function__ then sees the
            binding instead of the OpOverload.
        recompose_attention: rewrite the decomposed attention of a core-ATen graph (two bmms,
            a softmax and the ops around them) back into one scaled_dot_product_attention
            (asyncgraph/passes/recompose.py); results then agree with the graph's to float
            rounding.
        split_packed_qkv: split a packed in-projection (nn.MultiheadAttention's) into q, k
            and v with one view, one permute and three selects instead of 17 nodes and a copy
            (asyncgraph/passes/qkv.py): 20 us less per attention layer at tiny BERT's size.
            The heads are then views of the projection with other strides, read only by
            scaled_dot_product_attention.
        fold_constants: run the nodes that read only weights once per weights version (at
            construction and on swap_weights) instead of on every call
            (asyncgraph/passes/folding.py);
            they leave the graph, so they are not in placements, profiles or traces.
        lower_linear: with fold_constants, run each CPU `linear` on its weight's transpose,
            folded once per weights version (asyncgraph/passes/linear.py): over a 2-D input
            with a bias as `addmm`, the op `at::linear` calls, without its per-call argument
            parsing and transpose. The node keeps its name; profiles and traces show `addmm`.
        pretranspose_weights: with lower_linear, fold that transpose into a contiguous copy
            (and a core-ATen graph's `permute(W, [1, 0])` before `addmm`/`mm` too): BLAS then
            reads the weight in the layout small products run fastest on (1.4-2.5x per
            product at 1-16 rows; tiny BERT 0.78x nativert's time against 0.99x), for one more
            copy of every linear weight in memory and results equal to float rounding instead
            of bitwise. False keeps the transpose a view: no copy, bitwise the same.
        fuse_activations: run a CPU `addmm` whose only reader is a `relu` or an exact `gelu`
            as one `_addmm_activation` (asyncgraph/passes/epilogue.py): the activation in
            place on the product, one call and one allocation less per layer; bitwise the
            same. The node keeps the addmm's name.
        segments: the delegate backends that replace runs of nodes, by name, planned in this
            order when the Executor is built (asyncgraph/runtime/delegates.py; each delegate
            node is profiled and traced as one, and cancellable only between segments):
            "script": each long run of CPU aten nodes (8 or more) becomes one delegate node
            that calls a torch.jit.trace of the run, traced per input shape on a thread of
            its own (asyncgraph/compiled/scripted.py): TorchScript's interpreter runs the ops
            from C++ with the GIL released, so a call costs less and executions on worker
            threads run in parallel; torch.jit is deprecated from torch 2.13.
            "onnx": each such run becomes one delegate node that calls an ONNX Runtime
            session of the run (asyncgraph/compiled/onnx_segments.py; the
            `asyncgraph[onnxruntime]` extra): exported when the Executor is built (seconds; a
            run the exporter refuses keeps its plain nodes, with the reason logged), checked
            against the plain nodes on the first call of each input signature, weights baked
            in per weights version (a swap makes a new session), `intra_op_threads` threads
            per session (1 when it is None), the GIL released.
            Other backends register themselves (`register_backend`). () (the default): none.
        fast_paths: build the program's faster forms off the loop (each segment backend
            registered as a fast form that can run here: "onnx" when onnxruntime imports)
            and serve each input signature with the one measured faster, the plain graph
            until then (asyncgraph/runtime/forms.py). Only where `segments` is () and the
            program runs on the CPU, untraced, with the default kernel factory. False keeps
            the plain graph only; the default is True unless the environment's
            ASYNCGRAPH_FAST_PATHS is 0 (or false, off, no).
        script_segments, onnx_segments: deprecated spellings of segments=("script",) and
            segments=("onnx",), accepted by the constructor only (they warn, and add their
            backend to `segments`; read `segments`). DEPRECATED_KEYWORDS lists every
            deprecated keyword argument.
        max_fused_nodes: the longest run of consecutive inline nodes compiled into one
            straight-line function (a unit); 1 runs every node as its own unit.
        cuda: how CUDA nodes run (CudaConfig: streams per execution, CUDA graphs and their
            warm-up); unused by programs without CUDA nodes.
        cuda_streams, cuda_graphs, cuda_graph_warmup: deprecated spellings of
            cuda=CudaConfig(streams=..., graphs=..., graph_warmup=...): the constructor (and
            dataclasses.replace) still takes them, warns, and sets them in `cuda`; reading
            them gives `cuda`'s values.
        move_inputs_to_device: move a tensor input that is on another device than the program
            was exported for (a CPU tensor for a CUDA program, say) instead of rejecting it;
            copies to a GPU are enqueued without a host wait. Off by default, because a silent
            copy per call hides a caller's mistake that costs time on every execution.
        batching: run concurrent requests in batches along dim 0 (BatchingConfig); needs a
            program whose inputs and outputs share a dynamic batch dimension 0 and whose rows
            are independent. The default, `CAPTURED_BATCHING`, batches only an Executor that
            replays whole executions as CUDA graphs of a program with a dynamic batch
            dimension (`BatchingConfig.only_captured`, into vLLM's bucket sizes): there one
            graph replay serves a whole batch; elsewhere every request runs as its own
            execution. None never batches. `Executor.batching` says what an Executor does.
        trace: record a span per node (thread, start, end) for traces and tests.
        ready_order_seed: when set, ready nodes are taken in a seeded random order instead of
            graph order; differential tests use it to shake out ordering bugs.
    """

    validate_inputs: bool = True
    free_values_after_use: bool = True
    max_parallel_ops: int = field(default_factory=_default_parallel_ops)
    intra_op_threads: int | None = None
    loop_intra_op_threads: int | None = 1
    pin_workers: bool = False
    worker_idle: bool = False
    worker_nice: int = 5
    worker_yield_s: float = 0.002
    max_concurrent_executions: int = 8
    max_frame_waiters: int = DEFAULT_MAX_FRAME_WAITERS
    min_frames: int = 1
    frame_cleanup_interval_s: float = 600.0
    max_unbounded_int: int = 1 << 24
    inference_mode: bool = True
    loop_slice_s: float = 0.001
    heavy_op_flops: int = 200_000
    adaptive_placement: bool = True
    profile_executions: int = 3
    placement_recheck_after: int = 20
    heavy_node_us: float = 80.0
    loaded_heavy_node_us: float = 250.0
    worker_execution_node_us: float | None = 40.0
    fast_bindings: bool = True
    recompose_attention: bool = True
    split_packed_qkv: bool = True
    fold_constants: bool = True
    lower_linear: bool = True
    pretranspose_weights: bool = True
    fuse_activations: bool = True
    segments: tuple[str, ...] = ()
    fast_paths: bool = field(default_factory=fast_paths_default)
    max_fused_nodes: int = 32
    cuda: CudaConfig = CudaConfig()
    move_inputs_to_device: bool = False
    batching: BatchingConfig | None = CAPTURED_BATCHING
    trace: bool = False
    ready_order_seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.segments, list):
            object.__setattr__(self, "segments", tuple(self.segments))
        check(self, EXECUTOR_RULES)

    @property
    def cuda_streams(self) -> int | None:
        """Deprecated: read `cuda.streams`."""
        return self.cuda.streams

    @property
    def cuda_graphs(self) -> bool:
        """Deprecated: read `cuda.graphs`."""
        return self.cuda.graphs

    @property
    def cuda_graph_warmup(self) -> int:
        """Deprecated: read `cuda.graph_warmup`."""
        return self.cuda.graph_warmup

    @property
    def intra_op_threads_or_default(self) -> int:
        """`intra_op_threads`, or the usable CPUs divided by `max_parallel_ops` (at least 1)
        capped by torch's count in this thread."""
        if self.intra_op_threads is not None:
            return self.intra_op_threads
        import torch  # not at the top: the CLI reads this module for --help

        per_worker = max(1, usable_cpus() // self.max_parallel_ops)
        return min(per_worker, max(1, torch.get_num_threads()))


def _take_deprecated_keywords(config_class: type[ExecutorConfig]) -> None:
    """Make `config_class`'s constructor take DEPRECATED_KEYWORDS too, each rewritten into the
    spelling that replaced it before the dataclass's own `__init__` (and its checks) runs.

    Not InitVars: `cuda_streams` and the like are also read-only properties, and
    dataclasses.replace passes every InitVar back in with the value it reads, which would
    undo the `cuda` given to replace; replace calls this constructor with the fields only,
    and with a deprecated name when its caller passes one (which then warns and maps)."""
    init = config_class.__init__

    @functools.wraps(init)
    def __init__(self: ExecutorConfig, *args: Any, **kwargs: Any) -> None:
        for name, rewrite in DEPRECATED_KEYWORDS.items():
            if name in kwargs:
                rewrite(kwargs, name, kwargs.pop(name))
        init(self, *args, **kwargs)

    setattr(config_class, "__init__", __init__)  # noqa: B010 - mypy refuses assigning a method


_take_deprecated_keywords(ExecutorConfig)
