"""Where the time of one execution goes, node by node (`asyncgraph profile` prints it).

Built on the trace spans (ExecutorConfig(trace=True)): the program runs `warmup` times, then
`runs` times one after another with spans recorded. Every figure is a mean per execution over
the same `runs` executions, so the figures add up: a node's time is the mean of its spans, the
summed node time is the sum of those, and per execution

    critical path <= nodes running <= wall,    nodes running <= summed node time

hold by construction (`nodes running` is the union of the execution's spans, which all lie
inside its wall time; a node starts after its inputs' producers ended, so a dependency chain's
spans do not overlap). `wall - nodes running` is the time no node ran: scheduling, and the
tracing itself, which records each span after its node ends. The summed node time exceeds
the time nodes ran only when nodes overlap on several threads. The report has the fields of
nativert's ProfileMetrics (time per node, time, percent and instances per op type, node
counts, total time) plus asyncgraph's own: where each node was placed, and these per-execution
times.

Traced executions run through the dataflow loop one node per unit (no fused straight line),
so their wall time is that of a traced execution, not of an untraced one. A span holds its
node's call and one clock read of the loop's (time.thread_time_ns, under a microsecond).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from asyncgraph.cuda.capturable import plan_capture
from asyncgraph.cuda.segments import segment_plan_for
from asyncgraph.graph.ir import Graph
from asyncgraph.kernels import KernelKind
from asyncgraph.runtime.executor import Executor
from asyncgraph.tools.compare import random_flat_inputs
from asyncgraph.tools.trace import Span, TraceRecorder


@dataclass(frozen=True)
class NodeTime:
    """One node: its mean time per execution and share of the summed node time."""

    index: int
    name: str
    op: str
    kind: str  # the kernel's kind (prim, cpu, ...), a device kernel's device type (cuda)
    placement: str  # runtime/plan.py's Placement, lower case (inline, worker, task, device)
    mean_us: float
    percent: float


@dataclass(frozen=True)
class ProfileMetrics:
    """nativert's ProfileMetrics, in snake_case, with asyncgraph's placement and wall time.

    `static_dispatch_nodes_count` counts the nodes whose kernel is an aten op called straight
    through its C++ OpOverload, asyncgraph's counterpart of nativert's static dispatch.
    """

    runs: int
    total_nodes_count: int
    prim_nodes_count: int
    static_dispatch_nodes_count: int
    time_per_node: list[NodeTime]
    time_per_node_type: dict[str, float]  # microseconds per execution
    percent_per_node_type: dict[str, float]
    instances_per_node_type: dict[str, int]
    placement_counts: dict[str, int]
    # Per execution, each the mean over the same `runs` executions (the module docstring):
    total_time_us: float  # summed node time (the sum of time_per_node)
    wall_time_us: float  # the time of `await execute_flat(...)`
    busy_time_us: float = 0.0  # the time at least one node ran: the union of its spans
    critical_path_us: float = 0.0  # the longest chain of dependent nodes' spans
    outside_nodes_us: float = 0.0  # wall_time_us - busy_time_us: when no node ran, >= 0
    wall_median_us: float = 0.0  # the median wall time, for the spread (slow outliers)
    folded_nodes_count: int = 0  # run once per weights version, not per execution
    # GPU programs: whether executions are captured as CUDA graphs, and if not, why (None
    # without CUDA nodes). Decided for the program as configured without tracing: profiled
    # (traced) executions themselves always run node by node.
    cuda_graphs: str | None = None
    # A GPU program that is not wholly captured: its segments (cuda/segments.py), then each
    # node left out with why; empty otherwise.
    cuda_graph_segments: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def example_inputs(ex: Executor, seed: int = 0, *, use_random: bool = False) -> list[Any]:
    """Flat user inputs to run with: the program's saved example (unless `use_random`), else
    random ones.

    Random tensors take the example shapes the program was exported with, which satisfy its
    dimension constraints; integer tensors get small non-negative values (valid indices).
    """
    exported = ex.program.exported
    saved = getattr(exported, "example_inputs", None) if exported is not None else None
    if saved is not None and not use_random:
        leaves = torch.utils._pytree.tree_leaves(saved)
        if len(leaves) == len(ex.graph.signature.user_inputs):
            return list(leaves)
    return random_flat_inputs(ex.graph, seed)


async def collect(
    ex: Executor, inputs: Sequence[Any], runs: int = 20, warmup: int = 3
) -> ProfileMetrics:
    """Run `ex` and aggregate its spans; `ex` must have been made with trace=True."""
    recorder = ex.recorder
    if not isinstance(recorder, TraceRecorder):  # None without trace=True
        raise ValueError("profiling needs an Executor made with ExecutorConfig(trace=True)")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    for _ in range(warmup):
        await ex.execute_flat(inputs)
    recorder.clear()
    executions: list[_Execution] = []
    clock = time.perf_counter_ns
    for _ in range(runs):
        first = len(recorder.spans)
        start = clock()
        await ex.execute_flat(inputs)
        wall = clock() - start
        # every span of this execution was recorded before its last node completed
        executions.append(_Execution(wall, recorder.spans[first:]))
    recorder.clear()
    return _metrics(ex, executions)


async def fast_form_verdict(
    ex: Executor, inputs: Sequence[Any], limit_s: float = 60.0
) -> dict[str, Any] | None:
    """What the default path does with `inputs`: runs `ex` (an untraced Executor with
    `fast_paths`) until its fast form has a verdict for their signature or `limit_s` passed,
    and returns `statistics().forms` (None when no fast form applies). Profiling itself
    traces node by node, which fast forms never do: this says what serves without it. The
    runs are one at a time, so the verdict reached is the one for a caller alone; the one
    under load is reached by load (runtime/forms.py)."""
    deadline = time.monotonic() + limit_s
    while True:
        await ex.execute_flat(inputs)
        forms = ex.statistics().forms
        if forms is None:
            return None
        decided = forms["signatures"] and all(
            v["alone"]["form"] != "measuring" for v in forms["signatures"].values())
        if decided or (forms["state"] == "none" and forms["builds"]) or (
                time.monotonic() > deadline):
            return forms
        await asyncio.sleep(0.002)  # the build thread's turn


@dataclass(frozen=True)
class _Execution:
    wall_ns: int
    spans: list[Span]


@dataclass(frozen=True)
class _Times:
    """One execution's times in ns: node time summed, nodes running, critical path, wall."""

    per_node: list[int]
    busy: int
    critical_path: int
    wall: int


def _times(graph: Graph, execution: _Execution) -> _Times:
    per_node = [0] * len(graph.nodes)
    for span in execution.spans:
        per_node[span.node] += span.end_ns - span.start_ns
    busy, end = 0, None  # the union of the spans, by start
    for span in sorted(execution.spans, key=lambda s: s.start_ns):
        if end is None or span.start_ns >= end:
            busy += span.end_ns - span.start_ns
            end = span.end_ns
        elif span.end_ns > end:
            busy += span.end_ns - end
            end = span.end_ns
    chain = [0] * len(graph.nodes)  # nodes are in topological order
    for node in graph.nodes:
        producers = (graph.values[v].producer for v in node.inputs())
        chain[node.index] = per_node[node.index] + max(
            (chain[p] for p in producers if p is not None), default=0
        )
    return _Times(per_node, busy, max(chain, default=0), execution.wall_ns)


def _metrics(ex: Executor, executions: Sequence[_Execution]) -> ProfileMetrics:
    runs = len(executions)
    times = [_times(ex.graph, e) for e in executions]
    mean_us = [sum(t.per_node[i] for t in times) / runs / 1e3 for i in range(len(ex.graph.nodes))]
    total = sum(mean_us)
    nodes = []
    by_type: dict[str, float] = defaultdict(float)
    instances: dict[str, int] = defaultdict(int)
    placements: dict[str, int] = defaultdict(int)
    prim = aten = 0
    for node, kernel, us in zip(ex.graph.nodes, ex.kernels, mean_us, strict=True):
        op = node.target_name()
        placement = ex.plan.placement[node.index].name.lower()
        nodes.append(NodeTime(node.index, node.name, op, kernel.where, placement, us,
                              100 * us / total if total else 0.0))
        by_type[op] += us
        instances[op] += 1
        placements[placement] += 1
        prim += kernel.kind is KernelKind.PRIM
        aten += kernel.kind is not KernelKind.PRIM and isinstance(
            node.target, torch._ops.OpOverload
        )
    order = sorted(by_type, key=lambda k: -by_type[k])
    return ProfileMetrics(
        runs=runs,
        total_nodes_count=len(nodes),
        prim_nodes_count=prim,
        static_dispatch_nodes_count=aten,
        time_per_node=nodes,
        time_per_node_type={k: by_type[k] for k in order},
        percent_per_node_type={k: 100 * by_type[k] / total if total else 0.0 for k in order},
        instances_per_node_type={k: instances[k] for k in order},
        placement_counts=dict(placements),
        total_time_us=total,
        wall_time_us=sum(t.wall for t in times) / runs / 1e3,
        busy_time_us=sum(t.busy for t in times) / runs / 1e3,
        critical_path_us=sum(t.critical_path for t in times) / runs / 1e3,
        outside_nodes_us=sum(t.wall - t.busy for t in times) / runs / 1e3,
        wall_median_us=statistics.median(t.wall for t in times) / 1e3,
        folded_nodes_count=ex.statistics().folded_nodes,
        cuda_graphs=cuda_graph_decision(ex),
        cuda_graph_segments=cuda_graph_segments(ex),
    )


def cuda_graph_decision(ex: Executor) -> str | None:
    """Whether `ex`'s program is captured as CUDA graphs when not traced, and if not, why
    (CapturePlan.describe); None for a program without CUDA nodes."""
    if ex.stream_plan is None:
        return None
    untraced = dataclasses.replace(ex.config, trace=False)
    return plan_capture(ex.graph, ex.plan, ex.stream_plan, ex.kernels, untraced).describe()


def cuda_graph_segments(ex: Executor) -> tuple[str, ...]:
    """The segments `ex`'s program is captured in when not traced, and the nodes left out with
    why (SegmentPlan.describe); empty without CUDA nodes or when whole executions are."""
    if ex.stream_plan is None:
        return ()
    untraced = dataclasses.replace(ex.config, trace=False)
    capture = plan_capture(ex.graph, ex.plan, ex.stream_plan, ex.kernels, untraced)
    if capture.capturable:
        return ()
    plan = segment_plan_for(capture, ex.graph, ex.stream_plan, ex.kernels, untraced)
    return tuple(plan.describe(ex.graph))
