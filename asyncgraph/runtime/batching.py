"""Dynamic batching: the rows of concurrent requests run as one execution.

Why: on a CPU a small model's request is hundreds of small ops, each taking and releasing the
GIL, so concurrent callers convoy on the GIL whatever runs them (threads or the loop). Stacking
the requests that wait at the same moment along the batch dimension runs each op once per batch
instead of once per request: fewer, larger ops, the same arithmetic. Triton's dynamic batcher and
TorchServe's batch_size do the same for services; here it is a property of the Executor, so
`await executor.execute(x)` is unchanged for the caller.

When it applies (checked once, from the signature, by `batch_layout`): dim 0 of every tensor
input and every output is the same dynamic symbol (export with `dynamic_shapes={..: {0:
Dim("batch")}}`), the symbol appears in no other dimension, and the program mutates neither
inputs nor buffers. Rows must be independent (no op mixes rows, as batch-norm in training or
a sum over dim 0 would): that is the user's promise when turning batching on, as with Triton.

How (`Batcher`): each request is validated alone, then queued with a key (the shapes past dim 0,
dtypes, devices, and the values of non-tensor inputs); requests with equal keys can share a
batch. A dispatch callback runs once per loop iteration after the callers of that iteration have
queued, so the callers that arrive together are batched together without a timer;
`max_delay_s` can hold a batch that is not full a little longer (one that fills meanwhile
leaves at once). At most `max_concurrent_batches` run at once; the next batch forms from
everything that queued meanwhile, so batches grow with load and stay at one request when there
is none. At most `max_queued_requests` wait; the next caller gets OverloadedError at once.

A batch grows up to `max_batch_size` rows and, when set, `max_batch_bytes` bytes of batched
inputs, whichever it would pass first; a request past either limit by itself runs alone.

Stacking copies every input row once. With CUDA graphs (or tensors on a GPU), a batch of a
bucket's size (padding below) is copied request by request (one `_foreach_copy_` into the
blocks of a `split`) into a bucket-sized input kept per bucket and batch key
(bucket_inputs.py's `BucketInputs`), the padding filled by copying the last row: no
torch.cat, no new tensor, and on a GPU nothing but enqueued copies on the loop thread's
current stream, which the execution's streams are ordered after. On an Executor that replays
whole executions the rows are copied where they are read (`BucketRows`): a replay copies
them straight into its graph's static inputs, and the kept input is filled only for the
stream path. The input goes back to its bucket once the execution
has returned (on a GPU: its work done, `FrameStreams.finish`), unless an output shares its
memory (an input returned as an output), which then keeps it. Other batches, and every batch
of an uncaptured CPU program (where one torch.cat costs a seventh of the copies), are stacked
with torch.cat. A batch on the CPU whose stacked inputs pass `OFFLOAD_BYTES` is stacked on a
thread (a CPU copy holds the loop for its whole length; torch.cat and copy_ release the
GIL); smaller ones stack inline, cheaper than the thread hop. Tensors on a GPU are never
stacked on a thread: the copy is GPU work the host only enqueues. Each batch's outputs are
split back into per-request views. A failing batch of several requests runs each request
alone, so one bad request fails alone. A request cancelled while queued leaves the queue; a
batch whose callers have all gone is cancelled.

Padding (`BatchingConfig.buckets`): a batch is padded with copies of its last row up to the
next bucket, and the padding's output rows are dropped. CUDA graphs are captured per input
signature, so without it every batch size would be a capture of its own; with buckets, a few
captures serve all sizes. The default with CUDA graphs is vLLM's list (1, 2, 4, then
multiples of 8 up to max_batch_size; TensorRT-LLM pads the same way), thinned to at most
`MAX_DEFAULT_BUCKETS` sizes; an Executor keeps twice its buckets' signatures captured
(cuda/capture.py's `captured_signatures`), so two batch keys' buckets stay captured. A padded
batch that fails is retried request by request, unpadded.

On by default where it pays (`BatchingConfig(only_captured=True)`, `make_batcher`): on an
Executor that replays whole executions as CUDA graphs of a program `batch_layout` accepts;
anywhere else such a config runs every request alone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import sympy
import torch

from asyncgraph.errors import (
    BatchCancelledError,
    BatchingError,
    ExecutorClosedError,
    OverloadedError,
)
from asyncgraph.graph.ir import Graph, OutputKind, Ref, TensorSpec
from asyncgraph.runtime.backend import FutureLike, Handle, Loop, TaskLike, current_loop
from asyncgraph.runtime.bucket_inputs import BucketInputs, BucketRows
from asyncgraph.runtime.config import BatchingConfig
from asyncgraph.runtime.validation import signature_of
from asyncgraph.runtime.weights import ran_on, weights_ran_on

Run = Callable[[list[Any]], Awaitable[list[Any]]]

LOG = logging.getLogger("asyncgraph.batching")

#: Stacked CPU inputs larger than this are joined on a thread: torch.cat copies ~20-40 us per
#: MB (more on cold pages) and a thread hop costs ~60 us, so from here the hop is worth it.
#: A CPU heuristic: a GPU tensor's copy is enqueued, never waited for, so it never hops.
OFFLOAD_BYTES = 1 << 20

#: The most sizes `default_buckets` gives: cuda/capture.py's MAX_CAPTURES (8), the input
#: signatures an Executor keeps graph instances for, so that one batch key's buckets are all
#: kept captured (runtime/ cannot import cuda/; tests/integration/test_gpu_batching.py checks
#: the two agree).
MAX_DEFAULT_BUCKETS = 8

#: Bucket-sized inputs kept per (bucket, batch key), each with a free list of at most
#: max_concurrent_batches inputs; the least recently used key's are dropped past this.
MAX_BUCKET_INPUT_KEYS = 2 * MAX_DEFAULT_BUCKETS


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Which flat inputs are batched along dim 0 (the others must be equal within a batch),
    the batch sizes a batch is padded up to (`BatchingConfig.buckets`, resolved), and whether
    the Executor captures CUDA graphs (`captured`: bucket batches are copied into kept
    inputs, `BucketInputs`, as they are for tensors on a GPU) and replays whole executions
    of a program that hands no input back (`replayed`: a bucket batch's rows go straight
    into the graph's static inputs)."""

    batched: tuple[bool, ...]
    symbol: sympy.Symbol
    max_rows: int
    buckets: tuple[int, ...] = ()
    captured: bool = False
    replayed: bool = False

    def padding(self, rows: int) -> int:
        """Rows to add to a batch of `rows`: up to the next bucket, none past the last."""
        if rows <= 0:
            return 0
        for size in self.buckets:
            if size >= rows:
                return size - rows
        return 0


def default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """vLLM's capture sizes up to max_batch_size: 1, 2, 4, 8, then multiples of 8, and
    max_batch_size itself last. Past MAX_DEFAULT_BUCKETS sizes the multiples thin out (of 16,
    then 32, ...) until the list fits: (1, 2, 4, 8, 16, 24, 32) for 32, (1, 2, 4, 8, 16, 32,
    48, 64) for 64. Small batches, the common case at low load, pad by at most a few rows;
    large ones by less than a step."""
    small = [size for size in (1, 2, 4, 8) if size < max_batch_size]
    step = 8
    while True:
        multiples = [size for size in range(step, max_batch_size, step) if size > 8]
        sizes = (*small, *multiples, max_batch_size)
        if len(sizes) <= MAX_DEFAULT_BUCKETS:
            return sizes
        step *= 2


def batch_layout(
    graph: Graph, config: BatchingConfig, *, captured: bool = False, replayed: bool = False,
) -> BatchLayout:
    """The layout of a program that can batch, or a BatchingError saying why it cannot.
    `captured`: the Executor replays CUDA graphs, so `buckets=None` pads to default_buckets;
    `replayed`: it replays whole executions (BatchLayout)."""
    sig = graph.signature
    mutated = [o.target for o in sig.outputs
               if o.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)]
    if mutated:
        raise BatchingError(
            f"batching needs a program that mutates no inputs or buffers; this one mutates "
            f"{', '.join(map(str, mutated))}"
        )
    inputs = [(s.target or f"input {i}", graph.values[s.value].spec)
              for i, s in enumerate(sig.user_inputs)]
    tensors = [(path, spec) for path, spec in inputs if isinstance(spec, TensorSpec)]
    if not tensors:
        raise BatchingError("batching needs at least one tensor input; this program has none")
    symbol = _batch_symbol(*tensors[0])
    for path, spec in tensors:
        _check_batched(f"input {path!r}", spec, symbol)
    for i, out in enumerate(sig.user_outputs):
        out_spec = graph.values[out.arg.id].spec if isinstance(out.arg, Ref) else None
        if not isinstance(out_spec, TensorSpec):
            kind = type(out.arg) if out_spec is None else out_spec.type
            raise BatchingError(
                f"batching needs every output to be a tensor batched along dim 0; output {i} "
                f"is {kind.__name__}"
            )
        _check_batched(f"output {i}", out_spec, symbol)
    _lower, upper = sig.range_constraints.get(symbol, (0, float("inf")))
    if config.max_batch_size > upper:
        raise BatchingError(
            f"max_batch_size {config.max_batch_size} is above the largest batch the program "
            f"was exported for ({symbol} <= {int(upper)})"
        )
    buckets = config.buckets
    if buckets is None:
        buckets = default_buckets(config.max_batch_size) if captured else ()
    elif captured and len(buckets) > MAX_DEFAULT_BUCKETS:
        LOG.warning(
            "BatchingConfig.buckets has %d sizes, more than the %d input signatures an "
            "Executor keeps CUDA graphs for: under load the buckets evict each other's "
            "captures and capture again; give at most %d sizes",
            len(buckets), MAX_DEFAULT_BUCKETS, MAX_DEFAULT_BUCKETS,
        )
    return BatchLayout(
        tuple(isinstance(spec, TensorSpec) for _, spec in inputs), symbol,
        config.max_batch_size, buckets, captured, captured and replayed,
    )


def make_batcher(
    graph: Graph, config: BatchingConfig | None, run: Run, *, captured: bool,
    captures_whole: bool, inputs_out: bool = False,
) -> Batcher | None:
    """The Executor's Batcher for `config` (ExecutorConfig.batching), or None: batching off.

    `captured`: the Executor captures CUDA graphs (buckets default to `default_buckets`);
    `captures_whole`: it replays whole executions as graphs; `inputs_out`: the program hands
    an input back as an output (cuda/capturable.py's CapturePlan), so a replay must hand
    back the batch's own input, and its rows are copied there, not straight into the
    graph's static inputs (`BatchLayout.replayed`). A plain config batches or
    raises BatchingError; an `only_captured` one batches only with `captures_whole` and a
    program batch_layout accepts (its max_batch_size lowered to the largest batch the
    program was exported for), and is otherwise off without a word: the default that must
    not surprise a CPU program."""
    if config is None:
        return None
    if not config.only_captured:
        layout = batch_layout(graph, config, captured=captured,
                              replayed=captures_whole and not inputs_out)
        return Batcher(layout, config, run)
    if not captures_whole:
        return None
    config = _within_exported_batch(graph, config)
    try:
        layout = batch_layout(graph, config, captured=True, replayed=not inputs_out)
    except BatchingError:
        return None
    return Batcher(layout, config, run)


def _within_exported_batch(graph: Graph, config: BatchingConfig) -> BatchingConfig:
    """`config` with max_batch_size (and buckets) no larger than the program's batch symbol
    allows, when its first tensor input has one; as it is otherwise."""
    sig = graph.signature
    for spec in sig.user_inputs:
        tensor = graph.values[spec.value].spec
        if isinstance(tensor, TensorSpec) and tensor.shape:
            first = tensor.shape[0]
            if not isinstance(first, sympy.Symbol):
                return config
            upper = sig.range_constraints.get(first, (0, float("inf")))[1]
            if upper >= config.max_batch_size or upper < 1:
                return config
            buckets = config.buckets
            if buckets is not None:
                buckets = tuple(b for b in buckets if b <= upper)
            return dataclasses.replace(config, max_batch_size=int(upper), buckets=buckets)
    return config


def _batch_symbol(path: str, spec: TensorSpec) -> sympy.Symbol:
    first = spec.shape[0] if spec.shape else None
    if not isinstance(first, sympy.Symbol):
        raise BatchingError(
            f"batching needs dim 0 of every tensor input to be a dynamic batch dimension; "
            f"input {path!r} has shape {list(spec.shape)} (export with dynamic_shapes giving "
            "it {0: torch.export.Dim('batch')})"
        )
    return first


def _check_batched(what: str, spec: TensorSpec, symbol: sympy.Symbol) -> None:
    first = spec.shape[0] if spec.shape else None
    if first != symbol:
        raise BatchingError(
            f"batching needs dim 0 of every tensor input and output to be the batch dimension "
            f"{symbol}; {what} has shape {list(spec.shape)}"
        )
    for d in spec.shape[1:]:
        if isinstance(d, sympy.Expr) and symbol in d.free_symbols:
            raise BatchingError(
                f"{what} has shape {list(spec.shape)}: the batch dimension {symbol} appears "
                "past dim 0, so rows of different requests cannot be stacked"
            )


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """Requests and batches so far; `mean_rows` is the average batch size in rows, padding
    left out; `refused` counts the requests that found the queue full (OverloadedError);
    `padded_rows` the rows added to reach a bucket (BatchingConfig.buckets)."""

    requests: int
    batches: int
    rows: int
    largest_batch: int
    queued: int
    running: int
    cancelled_in_queue: int
    retried_alone: int
    refused: int = 0
    padded_rows: int = 0
    # executions that succeeded by the rows they ran (padding included): (count, seconds);
    # Triton's batch_stats (serve/statistics.py)
    by_size: dict[int, tuple[int, float]] = field(default_factory=dict)

    @property
    def mean_rows(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


class _Request:
    __slots__ = ("arrived", "batch", "flat", "future", "key", "nbytes", "rows",
                 "weights_version")

    def __init__(
        self, flat: list[Any], rows: int, key: Hashable, future: FutureLike, nbytes: int = 0
    ):
        self.flat = flat
        self.rows = rows
        self.key = key
        self.future = future
        self.nbytes = nbytes  # its batched tensors' bytes (counted with max_batch_bytes only)
        self.arrived = time.monotonic()
        self.batch: TaskLike | None = None
        self.weights_version: int | None = None  # what its batch ran on (weights_ran_on)


class Batcher:
    """Queues validated requests and runs them in batches through `run` (see module doc)."""

    def __init__(self, layout: BatchLayout, config: BatchingConfig, run: Run) -> None:
        self.layout = layout
        self.config = config
        self._run = run
        self._queue: deque[_Request] = deque()
        self._batches: dict[TaskLike, list[_Request]] = {}  # running, with members
        self._drained: anyio.Event | None = None  # set when the last running batch ends
        self.loop: Loop | None = None  # the event loop's seam, bound by the Executor
        self._dispatch_handle: Handle | None = None
        self._delay_timer = False  # whether _dispatch_handle is a max_delay_s timer
        self._closed = False
        self._requests = self._batch_count = self._rows = self._largest = 0
        self._by_size: dict[int, list[float]] = {}  # rows run -> [executions, seconds]
        self._cancelled_in_queue = self._retried_alone = self._refused = self._padded = 0
        self._waiting = 0  # requests in the queue that no one has cancelled
        # _rows_and_key's answer for the last signature it saw (requires_grad of the batched
        # inputs included, which the signature leaves out)
        self._batched_positions = [i for i, batched in enumerate(layout.batched) if batched]
        self._last_signature: Hashable | None = None
        self._last_answer: tuple[int, Hashable, list[bool]] = (0, (), [])
        self._bucket_sizes = frozenset(layout.buckets)
        self.bucket_inputs = BucketInputs(
            layout.batched, config.max_concurrent_batches, MAX_BUCKET_INPUT_KEYS)

    async def submit(self, flat: list[Any], signature: Hashable | None = None) -> list[Any]:
        """Run one validated request in a batch; its outputs, as if it had run alone.
        `signature`: the request's InputValidator.check, when validation made one."""
        if self._closed:
            raise ExecutorClosedError("the executor is closed; create a new one")
        self._check_room()
        loop = self._loop()
        future: FutureLike = loop.create_future()
        request = _Request(flat, *self._rows_and_key(flat, signature), future)
        if self.config.max_batch_bytes is not None:
            request.nbytes = self._request_bytes(request)
        self._queue.append(request)
        self._waiting += 1
        self._requests += 1
        self._schedule_dispatch()
        try:
            outputs: list[Any] = await future
            if request.weights_version is not None:  # the batch ran in a task of its own
                ran_on(request.weights_version)
            return outputs
        except loop.cancelled_exc:
            batch = request.batch
            if batch is None:
                self._cancelled_in_queue += 1
                self._waiting -= 1
            else:
                members = self._batches.get(batch)
                if members and all(r.future.done() for r in members):
                    batch.cancel()  # nobody waits for it any more
            raise

    def _check_room(self) -> None:
        """OverloadedError when max_queued_requests wait already (cancelled ones do not count,
        though they stay in the deque until a dispatch passes them)."""
        limit = self.config.max_queued_requests
        if self._waiting >= limit:
            self._refused += 1
            raise OverloadedError(
                f"{self._waiting} requests already wait in the batcher's queue "
                f"(BatchingConfig.max_queued_requests={limit}); raise max_queued_requests, "
                "max_batch_size or max_concurrent_batches, or shed load before calling",
                bound="BatchingConfig.max_queued_requests", limit=limit,
            )

    def _rows_and_key(
        self, flat: Sequence[Any], signature: Hashable | None = None
    ) -> tuple[int, Hashable]:
        """Rows of the request and what a batch-mate must match; a unique key when the
        request cannot share a batch (an unhashable scalar input, a tensor where the
        signature has none, or inconsistent rows: possible only with validation off).

        The answer depends on nothing but the validated `signature` (shapes, dtypes, devices,
        scalar values) and the batched tensors' requires_grad, so it is kept for the last
        signature, which validation hands back as the same object for a repeat caller: 0.6
        us instead of 2.3 on a one-input MLP, about a tenth of a batched request's cost.
        Without validation the signature is computed here and compared by value."""
        if signature is None:
            signature = signature_of(flat)
            if signature is None:  # an input neither a tensor nor a plain scalar
                return self._compute_rows_and_key(flat)
        grads = [flat[i].requires_grad for i in self._batched_positions]
        last = self._last_signature
        if (signature is last or signature == last) and grads == self._last_answer[2]:
            return self._last_answer[0], self._last_answer[1]
        rows, key = self._compute_rows_and_key(flat)
        if isinstance(key, tuple):  # not a key of its own
            self._last_signature, self._last_answer = signature, (rows, key, grads)
        return rows, key

    def _compute_rows_and_key(self, flat: Sequence[Any]) -> tuple[int, Hashable]:
        rows = -1
        key: list[Hashable] = []
        for batched, x in zip(self.layout.batched, flat, strict=True):
            if batched and isinstance(x, torch.Tensor) and x.dim() > 0:
                if rows not in (-1, x.shape[0]):
                    return max(rows, 1), object()
                rows = x.shape[0]
                key.append((tuple(x.shape[1:]), x.dtype, x.device, x.requires_grad))
            else:
                if isinstance(x, torch.Tensor):  # == on tensors is elementwise: never equal
                    return max(rows, 1), object()
                try:
                    hash(x)
                except TypeError:
                    return max(rows, 1), object()
                key.append((type(x), x))
        return (rows if rows >= 0 else 1), tuple(key)

    # -- dispatch ----------------------------------------------------------------------------

    def _schedule_dispatch(self) -> None:
        """Dispatch once, at the end of this loop iteration: every caller that runs in this
        iteration queues first. A pending max_delay_s timer gives way as soon as there is
        nothing to wait for (a full batch has queued, or the batcher is closing): a full batch
        leaves at once, and `_hold` re-arms the timer for what is left."""
        if self._delay_timer and (self._closed or self._full()):
            assert self._dispatch_handle is not None
            self._dispatch_handle.cancel()
            self._dispatch_handle = None
        if self._dispatch_handle is None:
            self._delay_timer = False
            self._dispatch_handle = self._loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._dispatch_handle = None
        self._delay_timer = False
        while self._queue and len(self._batches) < self.config.max_concurrent_batches:
            while self._queue and self._queue[0].future.done():  # cancelled while queued
                self._queue.popleft()
            if not self._queue:
                return
            if self._hold():
                return
            self._start(self._take())

    def _hold(self) -> bool:
        """Whether to wait for more requests (max_delay_s); schedules the dispatch if so."""
        delay = self.config.max_delay_s
        if delay <= 0 or self._closed or self._full():
            return False
        due = self._queue[0].arrived + delay
        wait = due - time.monotonic()
        if wait <= 0:
            return False
        self._dispatch_handle = self._loop().call_later(wait, self._dispatch)
        self._delay_timer = True
        return True

    def _full(self) -> bool:
        """Whether the waiting requests hold a full batch's rows or bytes (counting stops
        there, so this costs at most max_rows steps past the requests cancelled in the
        queue)."""
        rows = nbytes = 0
        max_bytes = self._max_bytes()
        for request in self._queue:
            if not request.future.done():
                rows += request.rows
                nbytes += request.nbytes
                if rows >= self.layout.max_rows or nbytes >= max_bytes:
                    return True
        return False

    def _max_bytes(self) -> float:
        limit = self.config.max_batch_bytes
        return float("inf") if limit is None else limit

    def _take(self) -> list[_Request]:
        """The oldest request and the next ones with its key, up to max_rows rows and
        max_batch_bytes bytes (the oldest alone may pass either: it runs alone)."""
        head = self._queue.popleft()
        batch, rows, nbytes, skipped = [head], head.rows, head.nbytes, deque[_Request]()
        max_rows, max_bytes = self.layout.max_rows, self._max_bytes()
        while self._queue and rows < max_rows and nbytes < max_bytes:
            request = self._queue.popleft()
            if request.future.done():
                continue
            if (request.key == head.key and rows + request.rows <= max_rows
                    and nbytes + request.nbytes <= max_bytes):
                batch.append(request)
                rows += request.rows
                nbytes += request.nbytes
            else:
                skipped.append(request)
        skipped.extend(self._queue)
        self._queue = skipped
        self._waiting -= len(batch)
        return batch

    def _start(self, batch: list[_Request]) -> None:
        task = self._loop().create_task(self._run_batch(batch))
        for request in batch:
            request.batch = task
        self._batches[task] = batch
        rows = sum(r.rows for r in batch)
        self._batch_count += 1
        self._rows += rows
        self._largest = max(self._largest, rows)

    # -- one batch ---------------------------------------------------------------------------

    async def _run_batch(self, batch: list[_Request]) -> None:
        task = batch[0].batch  # set by _start before this task's first step
        cancelled_exc = self._loop().cancelled_exc
        try:
            pad = self.layout.padding(sum(r.rows for r in batch))
            if len(batch) == 1 and not pad:
                await self._run_alone(batch[0])
                return
            self._padded += pad
            rows = sum(r.rows for r in batch) + pad
            inputs = self._bucket_inputs(batch, rows)
            try:
                joined = await self._joined(batch, pad, inputs)
                started = time.perf_counter()
                outputs = await self._run(joined)
                self._ran(rows, time.perf_counter() - started)
            except Exception:  # the bucket's inputs are dropped: the run may have kept them
                # one request failing padded is retried as it came: the padding may be
                # what failed (a size the program's guards refuse)
                if not self.config.retry_alone and len(batch) > 1:
                    raise
                self._retried_alone += 1
                async with anyio.create_task_group() as group:
                    for request in batch:
                        group.start_soon(self._run_alone, request)
                return
            if inputs is not None:  # the execution returned: nothing reads them now
                self.bucket_inputs.give_back((rows, batch[0].key), inputs, outputs)
            self._split(batch, outputs, pad)
        except cancelled_exc:
            for request in batch:
                self._abandon(request)
            raise
        except Exception as exc:
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
        finally:
            for request in batch:  # nothing is left waiting, whatever happened
                self._abandon(request)
            self._batches.pop(task, None)  # type: ignore[arg-type]
            if not self._batches and self._drained is not None:
                self._drained.set()
            if self._queue:
                self._schedule_dispatch()

    async def _run_alone(self, request: _Request) -> None:
        if request.future.done():
            return
        try:
            started = time.perf_counter()
            outputs = await self._run(request.flat)
        except Exception as exc:
            if not request.future.done():
                request.future.set_exception(exc)
        else:
            self._ran(request.rows, time.perf_counter() - started)
            request.weights_version = weights_ran_on()
            if not request.future.done():
                request.future.set_result(outputs)

    def _bucket_inputs(self, batch: list[_Request], rows: int) -> list[Any] | None:
        """Reusable inputs for a batch of `rows` rows, padding included (BucketInputs), when
        `rows` is a bucket, the batch has a key, and the Executor captures CUDA graphs or
        the tensors are on a GPU; None to stack it with torch.cat (on the CPU one cat costs
        0.2 us a request, the copies 1.4). Not for inputs that require grad: copies into a
        kept tensor would join their graph."""
        head = batch[0]
        if rows not in self._bucket_sizes or not isinstance(head.key, tuple):
            return None
        tensors = self._batched_tensors(head)
        if any(x.requires_grad for x in tensors):
            return None
        if not self.layout.captured and self._on_cpu(head):
            return None
        return self.bucket_inputs.take((rows, head.key), head.flat, rows)

    async def _joined(
        self, batch: list[_Request], pad: int, inputs: list[Any] | None
    ) -> list[Any]:
        """The batch's inputs: stacked (`_join`), or kept bucket `inputs` as BucketRows. On
        an Executor that replays whole executions (`layout.replayed`) their rows are copied
        where they are read, straight into a graph's static inputs (bucket_inputs.py);
        otherwise now. Inline, or on a thread for large CPU batches (OFFLOAD_BYTES; never
        for tensors on a GPU, whose copies are only enqueued)."""
        join: Callable[[], list[Any]]
        if inputs is None:
            join = partial(self._join, batch, pad)
        else:
            rows = BucketRows(inputs, [r.flat for r in batch], [r.rows for r in batch], pad,
                              self.layout.batched)
            if self.layout.replayed:
                return rows
            join = rows.materialise
        if self._on_cpu(batch[0]) and self._stacked_bytes(batch) > OFFLOAD_BYTES:
            return await anyio.to_thread.run_sync(join)
        return join()

    def _on_cpu(self, request: _Request) -> bool:
        """Whether the request's batched tensors are on the CPU (batch-mates share devices:
        the key)."""
        return all(x.device.type == "cpu" for x in self._batched_tensors(request))

    def _batched_tensors(self, request: _Request) -> list[torch.Tensor]:
        return [request.flat[i] for i in self._batched_positions
                if isinstance(request.flat[i], torch.Tensor)]

    def _stacked_bytes(self, batch: list[_Request]) -> int:
        """The bytes `_join` copies: the first request's per row times the batch's rows
        (batch-mates share their shapes past dim 0 and dtypes: the key)."""
        head = batch[0]
        if head.rows <= 0:
            return sum(self._request_bytes(r) for r in batch)
        return self._request_bytes(head) // head.rows * sum(r.rows for r in batch)

    def _request_bytes(self, request: _Request) -> int:
        return sum(
            x.numel() * x.element_size()
            for x, batched in zip(request.flat, self.layout.batched, strict=True)
            if batched and isinstance(x, torch.Tensor)
        )

    def _join(self, batch: list[_Request], pad: int) -> list[Any]:
        """The batch's flat inputs: batched inputs concatenated along dim 0, then `pad`
        copies of the last row (real data: padding rows take no path a request could not),
        the others as the first request has them (the key made them equal)."""
        flats = [r.flat for r in batch]
        joined = []
        for i, batched in enumerate(self.layout.batched):
            if not batched:
                joined.append(flats[0][i])
                continue
            rows = [f[i] for f in flats]
            if pad:  # padding(rows) > 0 only when some request has a row
                last = next(r for r in reversed(rows) if r.shape[0])[-1:]
                rows.append(last.expand(pad, *last.shape[1:]))
            joined.append(torch.cat(rows))
        return joined

    def _split(self, batch: list[_Request], outputs: list[Any], pad: int) -> None:
        """Each request's rows of every output (views of the batch's outputs; the padding's
        rows are dropped).

        Inline whatever the batch's size: views copy nothing, and a split costs ~0.4 us per
        request and output (51 us for 32 requests x 4 outputs), under a thread hop."""
        rows = [r.rows for r in batch] + ([pad] if pad else [])
        pieces = [torch.split(out, rows) for out in outputs]
        version = weights_ran_on()  # the batch's execution ran in this task
        for i, request in enumerate(batch):
            request.weights_version = version
            if not request.future.done():
                request.future.set_result([p[i] for p in pieces])

    # -- lifecycle ---------------------------------------------------------------------------

    async def aclose(self, *, cancel: bool = False) -> None:
        """Take no new requests; run the queued ones (or with `cancel`, cancel queued and
        running ones) and wait until no batch runs."""
        self._closed = True
        if cancel:
            for request in self._queue:
                self._abandon(request)
            self._queue.clear()
            for task in self._batches:
                task.cancel()
        while self._queue or self._batches:
            if self._batches:
                if self._drained is None or self._drained.is_set():
                    self._drained = anyio.Event()  # shared by concurrent aclose calls
                await self._drained.wait()
            else:
                self._schedule_dispatch()
                await anyio.lowlevel.checkpoint()

    def _abandon(self, request: _Request) -> None:
        """End a request the batcher gives up on while its caller may still wait (closed with
        cancel, or its batch task cancelled or ended without its result).

        On asyncio its future is cancelled: the caller gets CancelledError, as the callers
        aclose(cancel=True) cancels do. On trio a cancellation belongs to a cancel scope and
        cannot be raised at will (a cancelled future would raise concurrent.futures'
        CancelledError, asyncio's internals, into a trio program), so the caller gets a named
        error: ExecutorClosedError naming aclose(cancel=True) once the batcher is closed, else
        BatchCancelledError. A caller whose own scope was cancelled has left already.
        """
        future = request.future
        if future.done():
            return
        if self._loop().name == "asyncio":
            future.cancel()
        elif self._closed:
            future.set_exception(ExecutorClosedError(
                "the executor was closed with aclose(cancel=True) before this batched request "
                "ran to its end"
            ))
        else:
            future.set_exception(BatchCancelledError(
                "the batch of this request was cancelled before it produced the request's "
                "outputs (the batch's task was cancelled: the trio run is ending?)"
            ))

    def _loop(self) -> Loop:
        """The bound loop's seam; the running one for a Batcher used without an Executor."""
        if self.loop is None:
            self.loop = current_loop()
        return self.loop

    def _ran(self, rows: int, seconds: float) -> None:
        entry = self._by_size.setdefault(rows, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def statistics(self) -> BatcherStatistics:
        return BatcherStatistics(
            requests=self._requests,
            batches=self._batch_count,
            rows=self._rows,
            largest_batch=self._largest,
            queued=sum(1 for r in self._queue if not r.future.done()),
            running=len(self._batches),
            cancelled_in_queue=self._cancelled_in_queue,
            retried_alone=self._retried_alone,
            refused=self._refused,
            padded_rows=self._padded,
            by_size={rows: (int(n), s) for rows, (n, s) in self._by_size.items()},
        )
