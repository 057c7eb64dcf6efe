"""TraceRecorder: per-node spans (which thread ran which node, when), as Chrome trace JSON.

Enabled by ExecutorConfig(trace=True). Spans are appended from the loop and worker threads;
list.append is atomic, so recording costs two clock reads and one append per node. Only the
count of spans dropped past `max_spans` is a read-modify-write: it changes under a lock.

`chrome_trace()` lays the spans out the way ui.perfetto.dev and chrome://tracing read them:

- one row per thread: the event loop thread first, then each worker thread, then one row per
  CUDA stream (for spans recorded with `stream=`), each node a slice named after the node with
  its op and the shapes of its inputs and output from the signature;
- async kernels, which overlap other work on the loop thread, as async slices of their own;
- one async track per execution: `execution` spanning it, with `frame wait` (queued for a free
  frame), `queue` (frame taken, waiting for its first node to start) and `run` (first node
  start to last node end) nested inside, plus any other phase recorded for it.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncgraph.graph.ir import Graph, ScalarSpec, TensorSpec, ValueSpec

_STREAM_TID_BASE = 1_000_000
_WORKER_PREFIX = "asyncgraph-worker"


@dataclass(frozen=True, slots=True)
class Span:
    """One node of one execution, run on thread `thread` from `start_ns` to `end_ns`.

    `stream` is the CUDA stream a device kernel ran on (its row in the trace), else None.
    """

    execution: int
    node: int
    thread: int
    thread_name: str
    start_ns: int
    end_ns: int
    stream: int | None = None
    shape: Any = None  # the output's shape as it ran (runtime_shape), None when not a tensor


@dataclass(frozen=True, slots=True)
class OpTime:
    """Time spent in one op across the recorded spans."""

    op: str
    calls: int
    total_ns: int

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.calls if self.calls else 0.0


class TraceRecorder:
    """Collects node spans and execution phases (frame wait) for traces and tests."""

    def __init__(self, graph: Graph, max_spans: int = 1_000_000) -> None:
        self.graph = graph
        self.max_spans = max_spans
        self.spans: list[Span] = []
        self.phases: list[tuple[int, str, int, int]] = []
        self.dropped = 0  # spans and phases past max_spans; changed under _lock
        self._lock = threading.Lock()

    def node_span(
        self,
        execution: int,
        node: int,
        start_ns: int,
        end_ns: int,
        stream: int | None = None,
        shape: Any = None,
    ) -> None:
        if len(self.spans) < self.max_spans:
            thread = threading.current_thread()
            self.spans.append(Span(
                execution, node, thread.ident or 0, thread.name, start_ns, end_ns, stream, shape
            ))
        else:
            self._drop()

    def node_done(
        self, execution: int, node: int, start_ns: int, end_ns: int, result: Any
    ) -> None:
        """The run loop's hook (runtime/instrument.py): one node's span, with its result's shape."""
        self.node_span(execution, node, start_ns, end_ns, shape=runtime_shape(result))

    def phase(self, execution: int, name: str, start_ns: int, end_ns: int) -> None:
        """An execution-level interval, such as waiting for a frame."""
        if len(self.phases) < self.max_spans:
            self.phases.append((execution, name, start_ns, end_ns))
        else:
            self._drop()

    def _drop(self) -> None:
        """Count one dropped record; `+=` on an attribute is not atomic across threads
        (free-threaded CPython loses increments; the GIL hides it only by its switch points)."""
        with self._lock:
            self.dropped += 1

    def clear(self) -> None:
        self.spans.clear()
        self.phases.clear()
        with self._lock:
            self.dropped = 0

    # -- summaries -----------------------------------------------------------------------------

    def op_summary(self) -> list[OpTime]:
        """Time per op (aten.linear.default, ...), the most expensive first."""
        calls: dict[str, int] = defaultdict(int)
        total: dict[str, int] = defaultdict(int)
        for span in self.spans:
            op = self.graph.nodes[span.node].target_name()
            calls[op] += 1
            total[op] += span.end_ns - span.start_ns
        return sorted(
            (OpTime(op, calls[op], total[op]) for op in calls), key=lambda t: -t.total_ns
        )

    def execution_phases(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Each execution's phases by name: frame wait, queue, run and any recorded ones."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for span in self.spans:
            e = span.execution
            if e not in first or span.start_ns < first[e]:
                first[e] = span.start_ns
            if e not in last or span.end_ns > last[e]:
                last[e] = span.end_ns
        phases: dict[int, dict[str, tuple[int, int]]] = defaultdict(dict)
        for execution, name, start, end in self.phases:
            phases[execution][name] = (start, end)
        for e, start in first.items():
            wait = phases[e].get("frame wait")
            if wait is not None and wait[1] <= start:
                phases[e]["queue"] = (wait[1], start)
            phases[e]["run"] = (start, last[e])
        return dict(phases)

    # -- Chrome trace ---------------------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """The spans as a Chrome trace-event document (ui.perfetto.dev opens it)."""
        pid = os.getpid()
        events: list[dict[str, Any]] = []
        rows: dict[int, str] = {}
        node_args = _NodeArgs(self.graph)
        for span in self.spans:
            node = self.graph.nodes[span.node]
            args = {**node_args[span.node], "execution": span.execution}
            if span.shape is not None:  # the signature's shapes may be symbolic: s0 x 64
                args["output_shape"] = span.shape
            ts, dur = span.start_ns / 1000, (span.end_ns - span.start_ns) / 1000
            if span.stream is not None:
                tid = _STREAM_TID_BASE + span.stream
                rows[tid] = f"cuda stream {span.stream}"
            else:
                tid = span.thread
                rows.setdefault(tid, _row_name(span.thread_name))
            if span.stream is None and node_args.is_async(span.node):
                ident = f"{span.execution}.{span.node}"
                events.append({"name": node.name, "cat": "async kernel", "ph": "b", "id": ident,
                               "pid": pid, "tid": tid, "ts": ts, "args": args})
                events.append({"name": node.name, "cat": "async kernel", "ph": "e", "id": ident,
                               "pid": pid, "tid": tid, "ts": ts + dur})
                continue
            events.append({"name": node.name, "cat": "node", "ph": "X", "pid": pid, "tid": tid,
                           "ts": ts, "dur": dur, "args": args})
        for execution, phases in sorted(self.execution_phases().items()):
            events.extend(_execution_events(pid, execution, phases))
        events.append({"name": "process_name", "ph": "M", "pid": pid,
                       "args": {"name": "asyncgraph"}})
        for tid, (index, name) in _ordered_rows(rows).items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": index}})
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"spans": len(self.spans), "dropped": self.dropped,
                          "executions": len({s.execution for s in self.spans})},
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()))


def _execution_events(
    pid: int, execution: int, phases: dict[str, tuple[int, int]]
) -> list[dict[str, Any]]:
    """One async track per execution: the whole execution with its phases nested inside."""
    start = min(s for s, _ in phases.values())
    end = max(e for _, e in phases.values())
    common = {"cat": "execution", "id": execution, "pid": pid, "tid": 0}
    events = [{"name": f"execution {execution}", "ph": "b", "ts": start / 1000,
               "args": {"execution": execution}, **common}]
    for name, (s, e) in sorted(phases.items(), key=lambda kv: kv[1]):
        events.append({"name": name, "ph": "b", "ts": s / 1000,
                       "args": {"execution": execution, "us": (e - s) / 1000}, **common})
        events.append({"name": name, "ph": "e", "ts": e / 1000, **common})
    events.append({"name": f"execution {execution}", "ph": "e", "ts": end / 1000, **common})
    return events


def _row_name(thread_name: str) -> str:
    if thread_name.startswith(_WORKER_PREFIX):
        return thread_name
    return f"event loop ({thread_name})"


def _ordered_rows(rows: dict[int, str]) -> dict[int, tuple[int, str]]:
    """Loop thread(s) first, then workers by name, then CUDA streams."""

    def key(item: tuple[int, str]) -> tuple[int, str]:
        tid, name = item
        group = 2 if tid >= _STREAM_TID_BASE else 1 if name.startswith(_WORKER_PREFIX) else 0
        return group, name

    return {tid: (i, name) for i, (tid, name) in enumerate(sorted(rows.items(), key=key))}


class _NodeArgs:
    """A node's slice arguments (op, input and output shapes), computed once per node."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._args: dict[int, dict[str, Any]] = {}
        self._async: dict[int, bool] = {}

    def __getitem__(self, index: int) -> dict[str, Any]:
        args = self._args.get(index)
        if args is None:
            node = self.graph.nodes[index]
            values = self.graph.values
            args = {
                "op": node.target_name(),
                "inputs": [_describe(values[v].spec) for v in node.inputs()],
                "output": _describe(values[node.output].spec),
            }
            self._args[index] = args
        return args

    def is_async(self, index: int) -> bool:
        flag = self._async.get(index)
        if flag is None:
            target = self.graph.nodes[index].target
            call = type(target).__call__ if callable(target) else None
            flag = inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)
            self._async[index] = flag
        return flag


def _describe(spec: ValueSpec | None) -> str:
    """`float32[s0, 64]` for a tensor, `int` for a scalar, `?` when the graph does not know."""
    if isinstance(spec, TensorSpec):
        dtype = str(spec.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(d) for d in spec.shape)}]"
    if isinstance(spec, ScalarSpec):
        return spec.type.__name__
    return "?"


def runtime_shape(value: Any) -> Any:
    """A tensor's shape as a list; for a tuple or list of tensors, the list of their shapes;
    None otherwise."""
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, (tuple, list)) and value and all(
        isinstance(v, torch.Tensor) for v in value
    ):
        return [list(v.shape) for v in value]
    return None
