"""Stream planning: which CUDA stream each CUDA node runs on, and which events order them.

This is the pure half of GPU execution; `asyncgraph.cuda.device` is the thin torch.cuda
layer that carries the plan out. Everything here is a function of the graph's structure, is
computed once per Executor, and is tested on machines without a GPU.

Why a static plan: the host enqueues a CUDA kernel in microseconds, long before the GPU runs
it, so ordering must be expressed to the GPU (stream order and events), not by the host
waiting. Deciding that ordering once, from the dataflow, keeps the per-node work at run time to
a few lookups.

Model. Each node has a `Role`:

- CUDA: enqueued on one of `streams_per_device` streams of its device.
- ALIAS: passes values through without reading them (getitem, tuple packing); a CUDA value
  that goes through it stays "on" its producer's stream.
- META: reads only tensor metadata (sizes, strides) and yields host values; never waits.
- SCALAR: a host op yielding host values (symbolic arithmetic, `.item()`, asserts); it waits on
  the host for the GPU values it reads, if any.
- HOST: any other host kernel (CPU kernels, Python callables, async functions). It waits for
  the GPU values it reads, and because it may itself make GPU tensors on its thread's current
  stream, CUDA nodes that read its output first wait on that stream (`fence`).

Rules, in topological order:

- Stream choice: a CUDA node continues on the stream of one of its CUDA producers on the same
  device whose stream no other consumer has continued yet (a chain stays on one stream, no
  event); otherwise (a root, or the second branch of a fork) it takes the least-loaded stream
  of its device by estimated cost, so independent branches spread over the streams.
- Waits: a CUDA node waits (`stream.wait_event`) on the events of the CUDA producers it reads
  that run on another stream, except those already ordered before it by another wait, by
  stream order, or by a host wait upstream (a transitive reduction over "ordered before").
- Host waits: a SCALAR or HOST node awaits, on the host, the events of the CUDA producers it
  reads (again reduced); graph outputs likewise (`output_waits`).
- record_stream: a CUDA node that reads a tensor made on another stream records its own
  stream on it, so the caching allocator does not hand the memory to the producer's stream
  while this node may still read it.

How many streams (`choose_streams`, `CudaConfig.streams=None`, the default): one, unless the
plan has independent branches whose estimated work is worth a stream of their own; then as
many as run such work at once, up to `AUTO_MAX_STREAMS`. An explicit `CudaConfig.streams` is
used as given. Why not always several: a second stream pays only while the GPU, not the host,
is what the execution waits for. Uncaptured, the host enqueues one node in about 10-12 us,
and a kernel of a few million multiply-adds is done long before the next is enqueued,
whatever stream it is on; the extra streams only add events and waits: on an H200 a wide MLP
ran uncaptured slower on 4 streams than on 1. Inside a CUDA graph the host launches nothing
and the GPU runs one kernel after another: the same MLP ran about twice as fast on 4 streams
(the figures: benchmarks/results/cpu/design_measurements.md#streams-when-uncaptured). So a
branch is worth a stream when it holds a
node of at least `UNCAPTURED_OVERLAP_WORK` multiply-adds (roughly the GPU time of the host's
10 us per node: an estimate above the measured points, not itself measured), or
`CAPTURED_OVERLAP_WORK` when executions are captured as CUDA graphs. Fewer streams also leave
more of torch's 32 capture streams per device to graph instances (cuda/instances.py: 32 / the
plan's streams).
"""

from __future__ import annotations

import builtins
import enum
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from asyncgraph.graph.ir import Graph, ScalarSpec, iter_refs
from asyncgraph.kernels.prim import PRIM_ATEN, PRIM_FUNCTIONS, make_list, make_tuple
from asyncgraph.runtime.device import ALIAS_KEY
from asyncgraph.runtime.plan import ExecutionPlan, Placement


class Role(enum.Enum):
    """What a node does with GPU values (see the module docstring)."""

    CUDA = "cuda"
    ALIAS = "alias"
    META = "meta"
    SCALAR = "scalar"
    HOST = "host"


StreamKey = tuple[int, int]
"""(device index, stream index within that device's set)."""

AUTO_MAX_STREAMS = 4
"""The most streams per device `choose_streams` gives one execution: beyond 4 the measured
branches gained nothing, and each stream of a captured plan costs a capture stream per graph
instance (32 per device)."""

UNCAPTURED_OVERLAP_WORK = 1 << 27
"""Multiply-adds (kernels/cost.py's estimate) of a node that makes its branch worth a stream
of its own when executions are not captured: 134M, 268 MFLOP, 4 us of an H200's fp32 peak and
some 5-10 us at the efficiency GEMMs of that size reach: about as long as the host takes to
enqueue one node (10-12 us). An estimate: the measured point below it is the wide MLP, whose
16.8M-multiply-add linears ran slower on 4 streams than on 1 (design_measurements.md,
"Streams when uncaptured"); none above it has been measured."""

CAPTURED_OVERLAP_WORK = 1 << 20
"""The same inside a CUDA graph, where the host launches nothing: 1M multiply-adds, well under
the 4.2M linears of examples/gpu_check.py that ran faster on 4 streams (the same section),
above elementwise kernels of a few thousand elements that end before another could start."""


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """Stream assignment and event dependencies of one graph; shared by all executions.

    All tuples are indexed by node. Node lists name nodes by index; a node's value is the
    value it produces.

    Attributes:
        streams_per_device: streams in one execution's set, per device.
        roles: each node's Role.
        device: the CUDA device of each CUDA node, None for the others.
        stream: the stream index (within its device's set) of each CUDA node, None otherwise.
        waits: for each CUDA node, the CUDA nodes on other streams whose events its stream
            waits on before its kernel is enqueued.
        fence: for each CUDA node, whether it reads a value a HOST node made (possibly a GPU
            tensor on that thread's current stream), so its stream first waits on the host
            thread's current and default streams.
        record_stream: for each CUDA node, the producers whose values it reads that were made
            on another stream: their tensors get `record_stream(this node's stream)`.
        records_event: whether a node records an event after its kernel (some other stream or
            the host waits on it).
        host_waits: for each SCALAR or HOST node, the CUDA nodes whose events the host awaits
            before running it.
        output_waits: the CUDA nodes whose events the host awaits before reading the graph's
            outputs (the cuda layer awaits the end of every stream instead, which covers them).
        streams_used: the (device, stream) pairs that run at least one node, sorted.
        stream_choice: how `streams_per_device` was chosen: "CudaConfig.streams=N", or
            "auto: ..." with the reason (`choose_streams`).
    """

    streams_per_device: int
    roles: tuple[Role, ...]
    device: tuple[int | None, ...]
    stream: tuple[int | None, ...]
    waits: tuple[tuple[int, ...], ...]
    fence: tuple[bool, ...]
    record_stream: tuple[tuple[int, ...], ...]
    records_event: tuple[bool, ...]
    host_waits: tuple[tuple[int, ...], ...]
    output_waits: tuple[int, ...]
    streams_used: tuple[StreamKey, ...]
    stream_choice: str = ""

    @property
    def num_nodes(self) -> int:
        return len(self.roles)

    @property
    def cuda_nodes(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles) if r is Role.CUDA)

    @property
    def has_cuda(self) -> bool:
        return any(r is Role.CUDA for r in self.roles)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(sorted({d for d, _ in self.streams_used}))

    def key(self, node: int) -> StreamKey:
        """(device, stream) of a CUDA node."""
        device, stream = self.device[node], self.stream[node]
        if device is None or stream is None:
            raise ValueError(f"node {node} is not a CUDA node")
        return device, stream

    # -- DeviceRuns (runtime/device.py): how schedule.py fuses CUDA runs and what they call --

    def run_key(self, node: int, placement: Placement) -> StreamKey | None:
        """(device, stream) of a CUDA node placed DEVICE: consecutive ones on one stream fuse
        into a CUDA run; ALIAS_KEY for an inline alias node, which continues the run."""
        role = self.roles[node]
        if placement is Placement.DEVICE and role is Role.CUDA:
            return self.key(node)
        if placement is Placement.INLINE and role is Role.ALIAS:
            return ALIAS_KEY
        return None

    def before_node(self, node: int) -> list[str]:
        """`g.wait` / `g.fence` before a CUDA node of a run, only where the plan has them, as
        `FrameStreams.run` does for a single node."""
        lines = []
        if self.waits[node]:
            lines.append(f"g.wait({node}, s)")
        if self.fence[node]:
            lines.append(f"g.fence({node}, s)")
        return lines

    def after_node(self, node: int, value: Callable[[int], str]) -> list[str]:
        """`g.record_value` / `g.record_event` after it, likewise."""
        lines = [f"g.record_value({value(producer)}, s)" for producer in self.record_stream[node]]
        if self.records_event[node]:
            lines.append(f"g.record_event({node}, s)")
        return lines

    def describe(self) -> str:
        """One line per node that touches the GPU: for logs and failing tests."""
        lines = [f"streams: {self.stream_choice}"] if self.stream_choice else []
        for i, role in enumerate(self.roles):
            if role is Role.CUDA:
                extra = f" waits={list(self.waits[i])}" if self.waits[i] else ""
                extra += " fence" if self.fence[i] else ""
                extra += f" record_stream={list(self.record_stream[i])}" if self.record_stream[
                    i
                ] else ""
                extra += " event" if self.records_event[i] else ""
                lines.append(f"{i}: cuda:{self.device[i]} stream {self.stream[i]}{extra}")
            elif self.host_waits[i]:
                lines.append(f"{i}: {role.value} host waits {list(self.host_waits[i])}")
        if self.output_waits:
            lines.append(f"outputs: host waits {list(self.output_waits)}")
        return "\n".join(lines)


def plan_streams(
    producers: Sequence[Sequence[int]],
    roles: Sequence[Role],
    streams_per_device: int,
    *,
    devices: Mapping[int, int] | None = None,
    outputs: Iterable[int] = (),
    costs: Sequence[float] | None = None,
    stream_choice: str = "",
) -> StreamPlan:
    """Plan streams and events for a graph given as a DAG of nodes.

    Args:
        producers: for each node, the nodes whose values it reads (graph inputs and weights
            are left out). Nodes must be in topological order: every producer index is lower.
        roles: each node's Role.
        streams_per_device: streams available to one execution on each device (>= 1).
        devices: the device index of each CUDA node; missing entries mean device 0.
        outputs: the nodes whose values are graph outputs (of any kind).
        costs: estimated cost of each node, to balance branches over streams; default 1 each.
        stream_choice: how `streams_per_device` was chosen, kept in the plan for describe().
    """
    n = len(roles)
    if len(producers) != n:
        raise ValueError(f"{len(producers)} producer lists for {n} roles")
    if streams_per_device < 1:
        raise ValueError(f"streams_per_device must be >= 1, got {streams_per_device}")
    if costs is not None and len(costs) != n:
        raise ValueError(f"{len(costs)} costs for {n} nodes")
    devices = devices or {}
    prods: list[tuple[int, ...]] = []
    for i, ps in enumerate(producers):
        unique = tuple(dict.fromkeys(ps))
        for p in unique:
            if not 0 <= p < i:
                raise ValueError(f"node {i} reads node {p}: nodes must be in topological order")
        prods.append(unique)

    device: list[int | None] = [None] * n
    stream: list[int | None] = [None] * n
    # Per node, as bitsets over node indices:
    origins = [0] * n  # CUDA nodes whose results this node's value may carry
    from_host = [False] * n  # the value may hold a GPU tensor made on a host thread's stream
    host_done = [0] * n  # CUDA nodes the host has seen complete before this node runs
    ordered = [0] * n  # CUDA nodes ordered on the GPU before this CUDA node ends (incl. itself)
    continued = [False] * n
    load: dict[int, list[float]] = {}
    waits: list[tuple[int, ...]] = [()] * n
    fence = [False] * n
    record: list[tuple[int, ...]] = [()] * n
    host_waits: list[tuple[int, ...]] = [()] * n

    def reduce(candidates: list[int], known: int, extra: Iterable[int] = ()) -> tuple[int, ...]:
        """Drop candidates already ordered before another one (or complete: `known`)."""
        covered = known
        for o in (*candidates, *extra):
            covered |= ordered[o] & ~(1 << o)
        return tuple(o for o in candidates if not (covered >> o) & 1)

    for i, role in enumerate(roles):
        ps = prods[i]
        in_origins = 0
        known = 0
        for p in ps:
            in_origins |= origins[p]
            known |= host_done[p]
        sources = _bits(in_origins)

        if role is Role.CUDA:
            dev = devices.get(i, 0)
            if dev < 0:
                raise ValueError(f"node {i}: device index must be >= 0, got {dev}")
            device[i] = dev
            loads = load.setdefault(dev, [0.0] * streams_per_device)
            free = [o for o in sources if device[o] == dev and not continued[o]]
            if free:
                chosen = max(free)  # the latest producer: most likely on the critical path
                continued[chosen] = True
                s = stream[chosen]
                assert s is not None
            else:
                s = min(range(streams_per_device), key=lambda k: (loads[k], k))
            stream[i] = s
            loads[s] += max(float(costs[i]), 1.0) if costs is not None else 1.0
            key = (dev, s)
            cross = [o for o in sources if (device[o], stream[o]) != key]
            same = [o for o in sources if (device[o], stream[o]) == key]
            waits[i] = reduce(cross, known, same)
            fence[i] = any(from_host[p] for p in ps)
            record[i] = tuple(
                p for p in ps if any((device[o], stream[o]) != key for o in _bits(origins[p]))
            )
            reach = (1 << i) | known
            for o in sources:
                reach |= ordered[o]
            ordered[i] = reach
            origins[i] = 1 << i
            host_done[i] = known
        elif role is Role.ALIAS:
            origins[i] = in_origins
            from_host[i] = any(from_host[p] for p in ps)
            host_done[i] = known
        elif role is Role.META:
            host_done[i] = known
        else:  # SCALAR, HOST: the host reads the values
            host_waits[i] = reduce(sources, known)
            for o in sources:
                known |= ordered[o]
            host_done[i] = known
            from_host[i] = role is Role.HOST

    out_origins = 0
    for o in outputs:
        if not 0 <= o < n:
            raise ValueError(f"output node {o} does not exist")
        out_origins |= origins[o]
    output_waits = reduce(_bits(out_origins), 0)

    records_event = [False] * n
    for lists in (waits, host_waits):
        for ws in lists:
            for o in ws:
                records_event[o] = True
    for o in output_waits:
        records_event[o] = True

    used = sorted({(d, s) for d, s in zip(device, stream, strict=True) if d is not None
                   and s is not None})
    return StreamPlan(
        streams_per_device=streams_per_device,
        roles=tuple(roles),
        device=tuple(device),
        stream=tuple(stream),
        waits=tuple(waits),
        fence=tuple(fence),
        record_stream=tuple(record),
        records_event=tuple(records_event),
        host_waits=tuple(host_waits),
        output_waits=output_waits,
        streams_used=tuple(used),
        stream_choice=stream_choice,
    )


def choose_streams(
    producers: Sequence[Sequence[int]],
    roles: Sequence[Role],
    *,
    devices: Mapping[int, int] | None = None,
    costs: Sequence[float] | None = None,
    captured: bool = False,
) -> tuple[int, str]:
    """Streams per device for `CudaConfig.streams=None` (module docstring), and why.

    The measure is the plan's own: each node starts once its producers have finished and lasts
    its estimated cost (at least 1), as on a GPU with a stream per branch; the count is the
    most nodes of at least the overlap work (`CAPTURED_OVERLAP_WORK` when `captured`, else
    `UNCAPTURED_OVERLAP_WORK`) running at once on one device, between 1 and
    `AUTO_MAX_STREAMS`. A chain never overlaps itself, and light branches (or light roots
    beside a heavy chain) are not worth a stream: both get 1. Arguments as `plan_streams`'.
    """
    threshold = CAPTURED_OVERLAP_WORK if captured else UNCAPTURED_OVERLAP_WORK
    where = "captured" if captured else "uncaptured"
    if costs is None:
        return 1, "auto: 1 stream (no cost estimates)"
    width = _overlapping_heavy_nodes(producers, roles, costs, devices or {}, threshold)
    count = max(1, min(width, AUTO_MAX_STREAMS))
    if count == 1:
        return 1, (f"auto: 1 stream ({where}: no independent branches with a node of at "
                   f"least {threshold:,} multiply-adds)")
    return count, (f"auto: {count} streams ({where}: {width} independent branches with a "
                   f"node of at least {threshold:,} multiply-adds at once)")


def _overlapping_heavy_nodes(
    producers: Sequence[Sequence[int]],
    roles: Sequence[Role],
    costs: Sequence[float],
    devices: Mapping[int, int],
    threshold: float,
) -> int:
    """The most CUDA nodes of at least `threshold` cost that overlap in time on one device,
    each node starting when its producers end (as soon as possible) and lasting its cost.
    Producer indices out of order are left to `plan_streams` to reject."""
    finish = [0.0] * len(roles)
    spans: dict[int, list[tuple[float, float]]] = {}
    for i, role in enumerate(roles):
        start = max((finish[p] for p in producers[i] if 0 <= p < i), default=0.0)
        cost = float(costs[i]) if i < len(costs) else 1.0
        finish[i] = start + max(cost, 1.0)
        if role is Role.CUDA and cost >= threshold:
            spans.setdefault(devices.get(i, 0), []).append((start, finish[i]))
    widest = 0
    for device_spans in spans.values():
        # an end sorts before a start at the same time: back-to-back nodes do not overlap
        edges = sorted([(end, -1) for _, end in device_spans]
                       + [(start, 1) for start, _ in device_spans])
        running = 0
        for _, step in edges:
            running += step
            widest = max(widest, running)
    return widest


def _bits(mask: int) -> list[int]:
    """The indices of the set bits, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


# -- from a Graph and its ExecutionPlan ---------------------------------------------------------

_ALIAS_TARGETS = frozenset({operator.getitem, make_tuple, make_list, builtins.tuple, builtins.list})
_META_TARGETS = frozenset({builtins.len})
_META_ATEN = frozenset({
    "aten::sym_size.int", "aten::sym_numel", "aten::sym_stride.int", "aten::sym_storage_offset",
    "aten::sym_is_contiguous", "aten::_assert_tensor_metadata", "aten::sym_constrain_range",
    "aten::sym_constrain_range_for_size", "aten::_assert_scalar",
})
# Prim aten ops that read GPU data (item, async asserts) or may make GPU tensors.
_DATA_PRIM_ATEN = frozenset({"aten::scalar_tensor"})


def aten_names(target: object) -> tuple[str, str] | None:
    """An aten op's name and its name with the overload ("aten::add", "aten::add.Tensor"),
    as the role tables here and capturable.py's deny list spell them; None for a non-op."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    overload = getattr(target, "_overloadname", "default")
    name = str(schema.name)
    return name, (f"{name}.{overload}" if overload != "default" else name)


def node_role(graph: Graph, plan: ExecutionPlan, index: int) -> Role:
    """The Role of one node, from its placement, its target and its output spec."""
    if plan.placement[index] is Placement.DEVICE:
        return Role.CUDA
    node = graph.nodes[index]
    target = node.target
    if target in _ALIAS_TARGETS:
        return Role.ALIAS
    if target in _META_TARGETS:
        return Role.META
    names = aten_names(target)
    if names is not None:
        if names[0] in _META_ATEN or names[1] in _META_ATEN:
            return Role.META
        if names[0] in _DATA_PRIM_ATEN or names[1] in _DATA_PRIM_ATEN:
            return Role.HOST
        prim = names[0] in PRIM_ATEN or names[1] in PRIM_ATEN
    else:
        prim = target in PRIM_FUNCTIONS
    # A prim op whose result is known to be a host scalar cannot make a GPU tensor; anything
    # else (unknown spec, tensors, Python callables) might, so its CUDA readers fence.
    if prim and isinstance(graph.values[node.output].spec, ScalarSpec):
        return Role.SCALAR
    return Role.HOST


def stream_plan_for(
    graph: Graph,
    plan: ExecutionPlan,
    streams_per_device: int | None,
    *,
    costs: Sequence[float] | None = None,
    default_device: int = 0,
    captured: bool = False,
) -> StreamPlan:
    """The StreamPlan of an Executor's graph: roles from the plan's placement (DEVICE nodes
    are CUDA nodes), devices from the nodes' output specs (`cuda` without an index means
    `default_device`), every kind of graph output counted as an output.

    `streams_per_device` is `CudaConfig.streams`: a count, used as given, or None, chosen
    by `choose_streams` from the costs; `captured` says the executions are captured as CUDA
    graphs (`CudaConfig.graphs`), where smaller branches are worth a stream."""
    producers: list[list[int]] = []
    for node in graph.nodes:
        ps = [graph.values[v].producer for v in node.inputs()]
        producers.append([p for p in ps if p is not None])
    roles = [node_role(graph, plan, i) for i in range(len(graph.nodes))]
    devices: dict[int, int] = {}
    for i, role in enumerate(roles):
        if role is Role.CUDA:
            spec = graph.values[graph.nodes[i].output].spec
            index = getattr(getattr(spec, "device", None), "index", None)
            devices[i] = default_device if index is None else int(index)
    outputs = set()
    for out in graph.signature.outputs:
        for ref in iter_refs(out.arg):
            producer = graph.values[ref.id].producer
            if producer is not None:
                outputs.add(producer)
    if streams_per_device is None:
        streams_per_device, choice = choose_streams(
            producers, roles, devices=devices, costs=costs, captured=captured)
    else:
        choice = f"CudaConfig.streams={streams_per_device}"
    return plan_streams(
        producers, roles, streams_per_device, devices=devices, outputs=sorted(outputs),
        costs=costs, stream_choice=choice,
    )
