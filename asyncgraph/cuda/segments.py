"""Segments: the capturable CUDA parts of a program that is not wholly capturable (pure).

Why: `plan_capture` (graphs.py) captures whole executions only, so one host node (a `.item()`,
a CPU or Python kernel, an op that syncs) leaves every kernel of the program launched one by
one. A *segment* is a group of capturable nodes that runs as one unit of the schedule and,
after warm-up, as one CUDA-graph replay (`FrameSegments` in graphs.py); the host nodes around
it run as before.

What a segment is (decided once per Executor, `plan_segments`, tested on the CPU):

- Its nodes are *capturable*: CUDA aten ops that `capturable.node_blocker` accepts (not DENIED,
  not mutating, no boolean-mask index), and ALIAS / META nodes (they run on the host during
  the capture, reading no GPU data). Besides, a node may not read a value a host node made
  that is not a tensor (a `.item()` result, say: a replay would keep the captured value), nor
  a CPU tensor (a graph would keep the value it had when captured).
- It is *convex*: no path leaves it and comes back through another node, since that node
  would have to run in the middle of a replay. Groups are grown greedily in topological
  order; a capturable node reading a node that depends on the open group (through a host
  node) closes it and opens the next, and the split is reported.
- It has at least `MIN_CUDA_NODES` (2) CUDA nodes. A replay of one kernel is one launch, as
  the kernel's own launch is, plus a copy per input and a clone per output: no gain.
- Program-level blockers are those of whole capture: `cuda.graphs=False`, `trace=True`, a
  mutated buffer or input, several devices. Then no segment is planned, and `reason` says why.

`order` is a topological order of the nodes in which each segment is contiguous (the window
between a segment's first and last node: the nodes not depending on it first, then the
segment, then the nodes that depend on it), so schedule.py can make each segment one unit and
keep its units in topological order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asyncgraph.cuda.capturable import CapturePlan, node_blocker
from asyncgraph.cuda.capturable import producers as _producers
from asyncgraph.cuda.streams import Role, StreamKey, StreamPlan
from asyncgraph.graph.ir import (
    WEIGHT_KINDS,
    Graph,
    OutputKind,
    ScalarSpec,
    iter_refs,
)
from asyncgraph.kernels import OpKernel
from asyncgraph.runtime.config import ExecutorConfig

MIN_CUDA_NODES = 2
"""CUDA nodes a segment needs to be worth a graph (see the module docstring)."""

_TOO_SMALL = (
    "is the only CUDA node of its capturable group: one replay would cost what its own launch "
    "does, plus the input copies and output clones"
)


@dataclass(frozen=True, slots=True)
class Segment:
    """One captured group of nodes.

    Attributes:
        nodes: its nodes, in topological order.
        inputs: the frame slots it reads that no node of it makes (user inputs, weights,
            values made by host nodes); weights are read by address, the others are copied
            into static buffers per replay.
        weights: the subset of `inputs` that are weights (captured by address).
        made_inputs: the subset of `inputs` made by nodes (host nodes, other segments,
            uncaptured CUDA nodes): their tensors are `record_stream`ed on the origin stream,
            which copies them into the static buffers.
        outputs: the slots it makes that something outside reads (another node, the graph's
            outputs): cloned out of the graph's static memory per replay.
        drops: per node of `nodes`, the slots made inside that no later node of it reads
            (dropped during the capture, so the graph's pool can reuse their memory).
        origin: the (device, stream) of its first CUDA node: where it is captured and
            replayed.
        streams: the (device, stream) pairs its CUDA nodes use, origin first.
        sources: per node of `nodes`, the CUDA nodes of the segment whose results it reads
            on another stream (through ALIAS nodes): inside the capture it waits on their
            events (the StreamPlan's waits are reduced by orderings outside the segment).
        events: the nodes of the segment whose events nodes outside it wait on: recorded
            on the origin stream after each replay.
        split: why this segment is not part of the one before it, when it follows one.
    """

    nodes: tuple[int, ...]
    inputs: tuple[int, ...]
    weights: tuple[int, ...]
    made_inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    drops: tuple[tuple[int, ...], ...]
    origin: StreamKey
    streams: tuple[StreamKey, ...]
    sources: tuple[tuple[int, ...], ...]
    events: tuple[int, ...]
    split: str | None = None


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """The segments of a program, and why every other node is left out.

    `reason`: why no segment is planned at all (a setting, a program-level blocker); None
    otherwise. `excluded`: (node, reason) for each CUDA, SCALAR or HOST node outside every
    segment. `order`: see the module docstring (empty without segments).
    """

    segments: tuple[Segment, ...]
    excluded: tuple[tuple[int, str], ...]
    order: tuple[int, ...] = ()
    reason: str | None = None

    @property
    def segment_of(self) -> dict[int, int]:
        return {node: s for s, seg in enumerate(self.segments) for node in seg.nodes}

    def describe(self, graph: Graph) -> list[str]:
        """Lines for `asyncgraph profile`: each segment, then each excluded node and why."""
        if self.reason is not None:
            return [f"segments: none ({self.reason})"]
        lines = []
        for i, seg in enumerate(self.segments):
            cuda = ", ".join(graph.nodes[n].name for n in seg.nodes)
            line = f"segment {i}: {len(seg.nodes)} nodes on {len(seg.streams)} stream(s): {cuda}"
            if seg.split is not None:
                line += f" (split: {seg.split})"
            lines.append(line)
        if not self.segments:
            lines.append("segments: none")
        for node, why in self.excluded:
            n = graph.nodes[node]
            lines.append(f"not captured: node {n.name!r} ({n.target_name()}) {why}")
        return lines


def plan_segments(
    graph: Graph,
    stream_plan: StreamPlan,
    kernels: Sequence[OpKernel],
    config: ExecutorConfig,
) -> SegmentPlan:
    """The SegmentPlan of an Executor's graph (the graph that runs: after folding)."""
    reason = _program_blocker(graph, stream_plan, config)
    if reason is not None:
        return SegmentPlan((), (), (), reason)
    blockers = [
        _capture_blocker(graph, i, stream_plan, kernels) for i in range(len(graph.nodes))
    ]
    groups, splits = _convex_groups(graph, blockers)
    excluded = {i: why for i, why in enumerate(blockers) if why is not None}
    segments: list[Segment] = []
    for group, split in zip(groups, splits, strict=True):
        cuda = [n for n in group if stream_plan.roles[n] is Role.CUDA]
        if len(cuda) >= MIN_CUDA_NODES:
            segments.append(_segment(graph, stream_plan, group, split if segments else None))
        else:
            excluded.update((n, _TOO_SMALL) for n in cuda)
    listed = tuple(
        (i, why) for i, why in sorted(excluded.items())
        if stream_plan.roles[i] not in (Role.ALIAS, Role.META)
    )
    if not segments:
        return SegmentPlan((), listed)
    return SegmentPlan(tuple(segments), listed, _order(graph, segments))


def _program_blocker(graph: Graph, stream_plan: StreamPlan, config: ExecutorConfig) -> str | None:
    if not config.cuda.graphs:
        return "cuda.graphs=False"
    if config.trace:
        return "trace=True records a span per node, which a replay does not have"
    for out in graph.signature.outputs:
        if out.kind is OutputKind.BUFFER_MUTATION:
            return f"the program mutates buffer {out.target!r}: its weights change every execution"
        if out.kind is OutputKind.USER_INPUT_MUTATION:
            return f"the program mutates input {out.target!r}"
    if len(stream_plan.devices) > 1:
        return f"CUDA nodes on devices {list(stream_plan.devices)}: one graph captures one device"
    return None


def _capture_blocker(
    graph: Graph, index: int, stream_plan: StreamPlan, kernels: Sequence[OpKernel]
) -> str | None:
    """Why node `index` cannot be in a segment, or None."""
    role = stream_plan.roles[index]
    if role in (Role.SCALAR, Role.HOST):
        if stream_plan.host_waits[index]:
            return "reads a GPU value on the host"
        return f"runs on the host (role {role.value})"
    reason = node_blocker(graph, index, role, kernels[index], stream_plan)
    if reason is not None:
        return reason
    for v in graph.nodes[index].inputs():  # CPU tensors: node_blocker
        value = graph.values[v]
        spec = value.spec
        producer = value.producer
        if (
            producer is not None
            and stream_plan.roles[producer] in (Role.SCALAR, Role.HOST)
            and isinstance(spec, ScalarSpec)
        ):
            return (
                f"reads host value {value.name!r} made by node "
                f"{graph.nodes[producer].name!r}: a replay would keep the captured value"
            )
    return None


def _convex_groups(
    graph: Graph, blockers: Sequence[str | None]
) -> tuple[list[list[int]], list[str | None]]:
    """Greedy convex groups of capturable nodes, in topological order, with why each group
    after the first was split from the one before it.

    `after[i]`: node i is outside the open group and depends on it (a path from the group
    reaches it). A capturable node reading such a node would close a path that leaves the
    group and re-enters it, so the group is closed and the node opens the next one.
    """
    groups: list[list[int]] = []
    splits: list[str | None] = []
    current: list[int] = []
    members: set[int] = set()
    after = [False] * len(graph.nodes)
    split: str | None = None
    for node in graph.nodes:
        i = node.index
        producers = _producers(graph, i)
        if blockers[i] is None:
            outside = [p for p in producers if after[p]]
            if outside:
                groups.append(current)
                splits.append(split)
                p = graph.nodes[outside[0]]
                split = (
                    f"node {node.name!r} reads {p.name!r}, which depends on the group before "
                    "through a node that is not captured: one group would not be convex"
                )
                current, members = [], set()
                after = [False] * len(graph.nodes)
            current.append(i)
            members.add(i)
        else:
            after[i] = any(p in members or after[p] for p in producers)
    if current:
        groups.append(current)
        splits.append(split)
    return groups, splits


def _segment(
    graph: Graph, stream_plan: StreamPlan, group: list[int], split: str | None
) -> Segment:
    members = set(group)
    made = {graph.nodes[n].output for n in group}
    inputs: list[int] = []
    for n in group:
        for v in graph.nodes[n].inputs():
            if v not in made and v not in inputs:
                inputs.append(v)
    weight_ids = {spec.value for spec in graph.signature.inputs if spec.kind in WEIGHT_KINDS}
    graph_outputs = {ref.id for out in graph.signature.outputs for ref in iter_refs(out.arg)}
    read_outside = {
        v for node in graph.nodes if node.index not in members for v in node.inputs()
    }
    outputs = tuple(sorted(v for v in made if v in read_outside or v in graph_outputs))
    last: dict[int, int] = {}
    for position, n in enumerate(group):
        last.setdefault(graph.nodes[n].output, position)
        for v in graph.nodes[n].inputs():
            if v in made:
                last[v] = position
    drops: list[list[int]] = [[] for _ in group]
    for v, position in last.items():
        if v not in outputs:
            drops[position].append(v)
    cuda = [n for n in group if stream_plan.roles[n] is Role.CUDA]
    origin = stream_plan.key(cuda[0])
    streams = tuple(dict.fromkeys([origin, *(stream_plan.key(n) for n in cuda)]))
    carried: dict[int, frozenset[int]] = {}  # node -> CUDA nodes of the group its value carries
    sources: list[tuple[int, ...]] = []
    for n in group:
        role = stream_plan.roles[n]
        read: set[int] = set()
        for p in _producers(graph, n):
            read |= carried.get(p, frozenset())
        if role is Role.CUDA:
            key = stream_plan.key(n)
            sources.append(tuple(sorted(s for s in read if stream_plan.key(s) != key)))
            carried[n] = frozenset({n})
        else:
            sources.append(())
            carried[n] = frozenset(read) if role is Role.ALIAS else frozenset()
    events = tuple(
        n for n in cuda
        if stream_plan.records_event[n]
        and any(
            n in stream_plan.waits[u] or n in stream_plan.host_waits[u]
            for u in range(len(graph.nodes)) if u not in members
        )
    )
    return Segment(
        nodes=tuple(group),
        inputs=tuple(inputs),
        weights=tuple(v for v in inputs if v in weight_ids),
        made_inputs=tuple(v for v in inputs if graph.values[v].producer is not None),
        outputs=outputs,
        drops=tuple(tuple(sorted(d)) for d in drops),
        origin=origin,
        streams=streams,
        sources=tuple(sources),
        events=events,
        split=split,
    )


def _order(graph: Graph, segments: Sequence[Segment]) -> tuple[int, ...]:
    """A topological order with each segment contiguous: in each segment's window, the
    nodes that do not depend on it, then it, then those that do (the module docstring)."""
    order = list(range(len(graph.nodes)))
    for seg in segments:
        members = set(seg.nodes)
        first, last = seg.nodes[0], seg.nodes[-1]
        start, end = order.index(first), order.index(last)
        window = order[start:end + 1]
        depends: set[int] = set()
        for n in window:
            if n not in members and any(p in members or p in depends for p in _producers(graph, n)):
                depends.add(n)
        before = [n for n in window if n not in members and n not in depends]
        after = [n for n in window if n in depends]
        order[start:end + 1] = before + list(seg.nodes) + after
    return tuple(order)


def segment_plan_for(
    capture_plan: CapturePlan,
    graph: Graph,
    stream_plan: StreamPlan,
    kernels: Sequence[OpKernel],
    config: ExecutorConfig,
) -> SegmentPlan:
    """The segments of a program that is not wholly capturable (asyncgraph/cuda/segments.py);
    none when it is: whole-execution capture stays its path."""
    if capture_plan.capturable:
        return SegmentPlan((), (), (), "the whole execution is captured")
    return plan_segments(graph, stream_plan, kernels, config)
