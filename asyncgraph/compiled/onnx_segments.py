"""ONNX segments: runs of aten nodes run by ONNX Runtime (`ExecutorConfig(segments=("onnx",))`).

Why: at batch 1 on the CPU a plain graph spends its time in per-node Python dispatch (issue
40: an 8-layer MLP 2.99x ONNX Runtime's time, tiny BERT 2.66x). ONNX Runtime runs a whole
graph from C++, fusing as it goes (Gemm + Relu, SkipLayerNormalization), with the GIL
released. Here, as scripted.py does with TorchScript, each long run of aten nodes (the
segments of segments.py) becomes one delegate node (onnx_delegate.py) that runs an
InferenceSession of the run, exported by onnx_export.py when the Executor is built. The extra
is optional: `pip install 'asyncgraph[onnxruntime]'`.

What the delegate promises, as compiled segments do:

- **checked against the plain graph.** The export happens when the Executor is built: a run
  that torch.export or the ONNX exporter refuses keeps its plain nodes (an op without an ONNX
  function is left out and the rest of the run tried again), logged on the `asyncgraph.onnx`
  logger and kept in `OnnxPlan.skipped`. The numbers are checked on the first call of each
  input signature: that call runs the segment's fx module (the plain nodes' ops) and returns
  its outputs, and a builder thread ("asyncgraph-onnx-<segment>") runs the session on copies
  of the same inputs and compares; a signature whose outputs differ (beyond float rounding:
  delegate_support.CHECK_TOLERANCE) or that ONNX Runtime fails keeps running the fx module, and
  `statistics()["refused"]` says why. Only checked signatures run ONNX Runtime.
- **swappable weights.** Weights are baked into the session as initializers (ONNX Runtime
  folds and pre-packs them: 3-4x faster than passing them per call), given from the weight
  tensors' memory. The delegate keeps a session per weights version it has seen (up to
  MAX_SESSIONS) and picks the one whose tensors are the call's (by identity, as
  AOTIDelegate does), so each execution runs on the version it started with. A call on
  weights that no session holds yet (the first after a swap) runs the fx module while the
  builder thread makes that version's session (tiny BERT: ~20 ms); `prepare_weights` starts
  it when the swap happens.
- **cancellable between segments**: a segment is one node, and the scheduler stops between
  nodes.
- **the GIL released while it runs**: ONNX Runtime's `run` releases it. Sessions run
  sequentially with one intra-op thread, so a call runs on its caller's thread only, unless
  the user sets `ExecutorConfig.intra_op_threads` (then that count, as the executor's torch
  kernels get on a worker). Not the resolved default, CPUs / max_parallel_ops: unlike torch's
  one OpenMP team per thread, each session has a pool of its own, which spins for up to ~30
  ms after a call. On 2 vCPUs a pool of 2 made tiny BERT faster at batch 1 while no other pool
  spun, but alternating with another one both slowed down, and without spinning 2 threads
  were slower than one (benchmarks/results/cpu/design_measurements.md#onnx-intra-op-pools).

A call that fails in ONNX Runtime is run again as the fx module: when the plain nodes fail too
the error names the aten node that failed (as scripted.py's), otherwise the call returns the
plain outputs and its signature stays plain from then on.
"""


from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from asyncgraph.compiled.build import segment_module
from asyncgraph.compiled.onnx_delegate import LOG, OnnxDelegate
from asyncgraph.compiled.onnx_export import ONNX_DTYPES, ExportFailed, InputSpec, export_segment
from asyncgraph.compiled.scripted import unscriptable_reason
from asyncgraph.compiled.segments import Segment, replace_segments, tensor_bounded_segments
from asyncgraph.graph.ir import WEIGHT_KINDS, Graph, Node, OutputKind, TensorSpec
from asyncgraph.kernels.cost import estimate_cost
from asyncgraph.runtime.forms import build_cancelled

MIN_NODES = 8  # a run this long becomes a segment (a call into ONNX Runtime costs ~5-10 us)


@dataclass(frozen=True)
class SkippedSegment:
    """A run that keeps its plain nodes: its nodes and why."""

    nodes: tuple[str, ...]
    reason: str


@dataclass
class OnnxPlan:
    """What `plan_onnx_segments` did: the graph, its delegates' names and the runs left plain."""

    graph: Graph
    names: list[str] = field(default_factory=list)
    skipped: list[SkippedSegment] = field(default_factory=list)


def unexportable_reason(node: Node, graph: Graph) -> str | None:
    """Why a node segments.py accepts must still stay out of an ONNX segment, or None."""
    reason = unscriptable_reason(node)
    if reason is not None:
        return reason
    for vid in [node.output, *node.inputs()]:
        spec = graph.values[vid].spec
        if isinstance(spec, TensorSpec) and spec.dtype not in ONNX_DTYPES:
            return f"{node.target_name()} reads or makes a {spec.dtype} tensor"
    return None


def plan_onnx_segments(
    graph: Graph, min_nodes: int | None = None, *, intra_op_threads: int = 1
) -> OnnxPlan:
    """Each run of at least `min_nodes` (MIN_NODES) exportable aten nodes replaced by an
    OnnxDelegate node whose sessions use `intra_op_threads`; a run whose export fails keeps
    its plain nodes, with the reason (an op the exporter cannot translate is left out, and
    the rest of the run tried again). `graph` is without its dead code (the Executor's
    passes drop it, passes/deadcode.py, before any delegate plans): the exporter drops a node
    nothing reads with the weights only it reads, which the session would be handed all the
    same (a weight the exported model does not read is left out too: OnnxModel.unread)."""
    min_nodes = MIN_NODES if min_nodes is None else min_nodes
    excluded = {n.index for n in graph.nodes if unexportable_reason(n, graph) is not None}
    weights = {s.value: s.target or "" for s in graph.signature.inputs if s.kind in WEIGHT_KINDS}
    for spec in graph.signature.outputs:  # a buffer the program writes is read per call
        if spec.kind is OutputKind.BUFFER_MUTATION:
            weights = {v: n for v, n in weights.items() if n != spec.target}
    done: dict[tuple[int, int], tuple[Segment, OnnxDelegate]] = {}
    skipped: list[SkippedSegment] = []
    while True:
        segments = tensor_bounded_segments(
            graph, "auto", lambda vid: isinstance(graph.values[vid].spec, TensorSpec),
            excluded, min_nodes=min_nodes)
        retry = False
        for segment in segments:
            if (segment.start, segment.stop) in done:
                continue
            try:
                done[segment.start, segment.stop] = _delegate(
                    graph, segment, weights, intra_op_threads)
            except ExportFailed as failed:
                if build_cancelled():  # the Executor closed during a fast form's build
                    return OnnxPlan(graph, [], skipped)
                nodes = segment.nodes(graph)
                skipped.append(SkippedSegment(tuple(n.name for n in nodes), failed.reason))
                LOG.warning("nodes %s..%s stay plain: %s", nodes[0].name, nodes[-1].name,
                            failed.reason)
                culprits = {n.index for n in nodes if failed.op is not None
                            and n.target is failed.op}
                excluded |= culprits or {n.index for n in nodes}
                retry = bool(culprits)
        if not retry:
            break
    kept = [done[s.start, s.stop] for s in segments if (s.start, s.stop) in done]
    if not kept:
        return OnnxPlan(graph, [], skipped)
    names = [f"onnx_segment_{k}" for k in range(len(kept))]
    by_start = {}
    for name, (segment, delegate) in zip(names, kept, strict=True):
        delegate.__name__ = delegate.__qualname__ = name
        by_start[segment.start] = (name, delegate)
    return OnnxPlan(replace_segments(graph, [s for s, _ in kept], lambda s: by_start[s.start]),
                    names, skipped)


def _delegate(graph: Graph, segment: Segment, weights: dict[int, str],
              intra_op_threads: int) -> tuple[Segment, OnnxDelegate]:
    """The segment with its runtime inputs before its weights (a call then finds them by
    slicing), and its delegate (named by the caller); or ExportFailed."""
    segment = dataclasses.replace(segment, inputs=(
        *(v for v in segment.inputs if v not in weights),
        *(v for v in segment.inputs if v in weights)))
    specs = []
    for vid in segment.inputs:
        spec = graph.values[vid].spec
        assert isinstance(spec, TensorSpec)
        specs.append(InputSpec(spec.dtype, tuple(spec.shape), tuple(spec.hint),
                               baked=vid in weights))
    module = segment_module(graph, segment, names=True)
    model = export_segment(module, specs)
    nodes = segment.nodes(graph)
    static = all(isinstance(d, int) for s in specs if not s.baked for d in s.shape)
    delegate = OnnxDelegate(
        "onnx_segment", module, model, [n.name for n in nodes],
        sum(estimate_cost(n, graph) for n in nodes), static=static,
        weight_names=[weights[v] for v in segment.inputs if v in weights],
        intra_op_threads=intra_op_threads)
    return segment, delegate


def onnx_segments(
    graph: Graph, min_nodes: int | None = None, *, intra_op_threads: int = 1
) -> tuple[Graph, list[str]]:
    """The planning pass of the segment backend "onnx" (`ExecutorConfig(segments=("onnx",))`,
    runtime/delegates.py): `plan_onnx_segments`'s graph and delegate names."""
    plan = plan_onnx_segments(graph, min_nodes, intra_op_threads=intra_op_threads)
    return plan.graph, plan.names
