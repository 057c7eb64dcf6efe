"""TraceRecorder: per-node spans (which thread ran which node, when), as Chrome trace JSON.

Enabled by ExecutorConfig(trace=True). Spans are appended from the loop and worker threads;
list.append is atomic, so recording costs two clock reads and one append per node.
The JSON opens in ui.perfetto.dev and chrome://tracing: one row per thread.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgraph.graph import Graph


@dataclass(frozen=True, slots=True)
class Span:
    """One node of one execution, run on thread `thread` from `start_ns` to `end_ns`."""

    execution: int
    node: int
    thread: int
    thread_name: str
    start_ns: int
    end_ns: int


class TraceRecorder:
    """Collects node spans and execution phases (frame wait) for traces and tests."""

    def __init__(self, graph: Graph, max_spans: int = 1_000_000) -> None:
        self.graph = graph
        self.max_spans = max_spans
        self.spans: list[Span] = []
        self.phases: list[tuple[int, str, int, int]] = []

    def node_span(self, execution: int, node: int, start_ns: int, end_ns: int) -> None:
        if len(self.spans) < self.max_spans:
            thread = threading.current_thread()
            self.spans.append(
                Span(execution, node, thread.ident or 0, thread.name, start_ns, end_ns)
            )

    def phase(self, execution: int, name: str, start_ns: int, end_ns: int) -> None:
        """An execution-level interval, such as waiting for a frame."""
        if len(self.phases) < self.max_spans:
            self.phases.append((execution, name, start_ns, end_ns))

    def clear(self) -> None:
        self.spans.clear()
        self.phases.clear()

    def chrome_trace(self) -> dict[str, Any]:
        """The spans as a Chrome trace-event document (ui.perfetto.dev opens it)."""
        pid = os.getpid()
        events: list[dict[str, Any]] = []
        threads: dict[int, str] = {}
        for span in self.spans:
            threads[span.thread] = span.thread_name
            node = self.graph.nodes[span.node]
            events.append({
                "name": node.name, "cat": "node", "ph": "X", "pid": pid, "tid": span.thread,
                "ts": span.start_ns / 1000, "dur": (span.end_ns - span.start_ns) / 1000,
                "args": {"op": node.target_name(), "execution": span.execution},
            })
        for execution, name, start, end in self.phases:
            events.append({
                "name": name, "cat": "execution", "ph": "X", "pid": pid, "tid": 0,
                "ts": start / 1000, "dur": (end - start) / 1000,
                "args": {"execution": execution},
            })
        threads.setdefault(0, "executions")
        for tid, name in threads.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()))
