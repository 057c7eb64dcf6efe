"""Construction of an Executor as a pipeline: graph passes, kernels, folding, plan, device plans.

Everything here runs once per Executor, before the first execution, and produces what all
executions share (`Built`). The order matters and is the order of this file:

1. the graph passes (`GRAPH_PASSES`, each switched by its config field): rewrites of the graph
   that keep its meaning (attention put back together, identities and dead code dropped,
   packed q/k/v split, linears lowered onto folded transposes, activation epilogues fused);
2. the kernels, one per node (kernels/factory.py);
3. constant folding: what reads only weights is computed once (passes/folding.py), and the
   segment backends the config names replace runs of nodes by delegates, in its order
   (`config.segments`: "script", "onnx", or any backend registered by name in
   runtime/delegates.py, so that the runtime never imports compiled/); new nodes get kernels
   again, and every node a backend made must be a `Delegate`;
4. the execution plan: value slots, placement per node (runtime/plan.py);
5. with device nodes (placed DEVICE), the device plans (for CUDA: streams, capture plans,
   segments), made by the device backend registered under their kernels' device type
   (runtime/device.py's registry; cuda/backend.py is "cuda"), asked for only then, so a
   CPU-only program never imports cuda/ or touches torch.cuda;
6. the per-signature machinery: adaptive placement and the schedule cache.

A pass added to the library is one row of `GRAPH_PASSES`; `Executor.__init__` only calls
`build` and keeps what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from asyncgraph.graph.ir import Graph
from asyncgraph.kernels import KernelFactory, OpKernel
from asyncgraph.kernels.base import KernelKind
from asyncgraph.passes.deadcode import drop_dead_nodes
from asyncgraph.passes.epilogue import fuse_activations
from asyncgraph.passes.folding import ConstantFolder, fold_constants
from asyncgraph.passes.identity import drop_identities
from asyncgraph.passes.linear import lower_linear
from asyncgraph.passes.qkv import split_packed_qkv
from asyncgraph.passes.recompose import recompose_attention
from asyncgraph.runtime.config import ExecutorConfig, requested_batching
from asyncgraph.runtime.delegates import Delegate, segment_backend
from asyncgraph.runtime.device import DevicePlan, device_backend
from asyncgraph.runtime.placement import AdaptivePlacement, batch_bucket_key
from asyncgraph.runtime.plan import ExecutionPlan, Placement, build_plan
from asyncgraph.runtime.schedule import AtomicGroups, ScheduleCache

# A graph pass: the graph in, the rewritten graph and what it counted out (by counter name).
PassFn = Callable[[Graph, ExecutorConfig], tuple[Graph, dict[str, int]]]


@dataclass(frozen=True, slots=True)
class GraphPass:
    """One row of the pass pipeline: whether the config asks for it, and the pass."""

    name: str
    enabled: Callable[[ExecutorConfig], bool]
    run: PassFn


def _recompose(graph: Graph, config: ExecutorConfig) -> tuple[Graph, dict[str, int]]:
    graph, count = recompose_attention(graph)
    return graph, {"recomposed": count}


def _drop_identities(graph: Graph, config: ExecutorConfig) -> tuple[Graph, dict[str, int]]:
    graph, count = drop_identities(graph)
    return graph, {"dropped_identities": count}


def _drop_dead_nodes(graph: Graph, config: ExecutorConfig) -> tuple[Graph, dict[str, int]]:
    graph, _ = drop_dead_nodes(graph)
    return graph, {}


def _split_qkv(graph: Graph, config: ExecutorConfig) -> tuple[Graph, dict[str, int]]:
    graph, count = split_packed_qkv(graph)
    return graph, {"qkv_splits": count}


def _lower_linear(graph: Graph, config: ExecutorConfig) -> tuple[Graph, dict[str, int]]:
    lowering = lower_linear(graph, config.pretranspose_weights)
    return lowering.graph, {"lowered_linears": lowering.lowered, "weight_copies": lowering.copies}


def _fuse_activations(graph: Graph, config: ExecutorConfig) -> tuple[Graph, dict[str, int]]:
    graph, count = fuse_activations(graph)
    return graph, {"fused_activations": count}


GRAPH_PASSES: tuple[GraphPass, ...] = (
    GraphPass("recompose_attention", lambda c: c.recompose_attention, _recompose),
    GraphPass("drop_identities", lambda c: True, _drop_identities),  # dropouts returning x
    # what nothing reads, before anything plans on the graph: the delegates' exporters drop
    # such nodes with the weights only they read, which a segment would still hand over
    GraphPass("drop_dead_nodes", lambda c: True, _drop_dead_nodes),
    GraphPass("split_packed_qkv", lambda c: c.split_packed_qkv, _split_qkv),
    # linears read a folded transpose: only where constants fold
    GraphPass("lower_linear", lambda c: c.lower_linear and c.fold_constants, _lower_linear),
    GraphPass("fuse_activations", lambda c: c.fuse_activations, _fuse_activations),
)


@dataclass(slots=True)
class PassCounts:
    """What the graph passes did (Executor's public counters of the same names)."""

    recomposed: int = 0  # attention patterns put back together (passes/recompose.py)
    dropped_identities: int = 0  # dropouts that return their input (passes/identity.py)
    qkv_splits: int = 0  # packed q/k/v projections split by views (passes/qkv.py)
    lowered_linears: int = 0  # linears run on a folded transpose (passes/linear.py)
    weight_copies: int = 0  # of those transposes, copies (pretranspose_weights)
    fused_activations: int = 0  # addmm + relu/gelu as one node (passes/epilogue.py)


@dataclass(slots=True)
class Built:
    """What all executions of one Executor share, as the pipeline made it."""

    graph: Graph  # the executed graph: after the passes, folding and the segment backends
    passed: Graph  # the graph after the passes only: what a fast form builds on (forms.py)
    kernels: list[OpKernel]
    plan: ExecutionPlan
    schedules: ScheduleCache
    folder: ConstantFolder | None = None  # refolds the weights on a swap
    # each backend of config.segments -> the delegate nodes it made, in the config's order
    segments: dict[str, list[str]] = field(default_factory=dict)
    # every delegate node's target: the backends', and those a compiled package brought
    delegates: tuple[Delegate, ...] = ()
    counts: PassCounts = field(default_factory=PassCounts)
    device: DevicePlan | None = None  # with device nodes: cuda/backend.py's CudaPlans
    adaptive: AdaptivePlacement | None = None


def run_passes(graph: Graph, config: ExecutorConfig) -> tuple[Graph, PassCounts]:
    """Step 1: the graph passes the config enables, in `GRAPH_PASSES` order."""
    counts = PassCounts()
    for graph_pass in GRAPH_PASSES:
        if graph_pass.enabled(config):
            graph, counted = graph_pass.run(graph, config)
            for name, value in counted.items():
                setattr(counts, name, value)
    return graph, counts


def build(
    graph: Graph,
    config: ExecutorConfig,
    factory: KernelFactory,
    cuda_backend: object | None = None,
    passed: tuple[Graph, PassCounts] | None = None,
) -> Built:
    """Run the whole pipeline on an imported program's graph (the module docstring's steps).
    `passed`: step 1's result for this graph, already run by another Executor (a fast form
    is built on its Executor's: the passes were a third to two thirds of a form's build,
    Python that held the GIL while the loop served)."""
    graph, counts = passed if passed is not None else run_passes(graph, config)
    passed_graph = graph
    kernels = factory.create(graph)
    folder: ConstantFolder | None = None
    if config.fold_constants:  # the executed graph: without what reads only weights
        graph, kernels, folder = fold_constants(graph, kernels)
    graph, kernels, segments = plan_segments(graph, kernels, config, factory)
    plan = build_plan(graph, kernels, config)
    device = _device_plan(graph, plan, kernels, config, cuda_backend)
    adaptive = (
        AdaptivePlacement(
            graph, plan, kernels,
            profile_executions=config.profile_executions,
            recheck_after=config.placement_recheck_after,
            heavy_node_us=config.heavy_node_us,
            loaded_heavy_node_us=config.loaded_heavy_node_us,
            loop_slice_us=config.loop_slice_s * 1e6,
            worker_execution_node_us=config.worker_execution_node_us,
            key=batch_bucket_key if requested_batching(config) is not None else None,
        )
        if config.adaptive_placement
        else None
    )
    if adaptive is not None and device is not None and not any(adaptive.movable):
        adaptive = None  # a GPU program with no node to move: profiling would delay capture
    groups = device.atomic_groups() if device is not None else None
    schedules = ScheduleCache(
        graph, plan, kernels, config.max_fused_nodes,
        # a CPU node reading GPU values may have to wait for them: it is never fused
        unfusable=device.unfusable if device is not None else None,
        decided=adaptive.decision if adaptive is not None else None,
        stream_plan=device.runs if device is not None else None,  # one stream's nodes fuse
        # each captured segment is one unit (cuda/segments.py)
        segments=AtomicGroups(*groups) if groups is not None else None,
        any_thread=adaptive.any_thread if adaptive is not None else None,  # straight lines
    )
    prebuild_schedules(schedules, adaptive.base if adaptive is not None else plan.placement,
                       config, profiled=adaptive is not None)
    return Built(
        graph, passed_graph, kernels, plan, schedules, folder, segments, delegates_of(kernels),
        counts, device, adaptive,
    )


def prebuild_schedules(
    schedules: ScheduleCache, base: tuple[Placement, ...], config: ExecutorConfig, profiled: bool
) -> None:
    """The schedules of the first executions, built with the Executor rather than on the loop
    in its first requests (1-1.5 ms each for tiny BERT's fused one, several per first burst):
    the first placement's fused schedule, and its unfused one that profiled runs take."""
    fuse = not config.trace and config.ready_order_seed is None
    schedules.get(base, fuse)
    if fuse and profiled:
        schedules.get(base, False)


def plan_segments(
    graph: Graph, kernels: list[OpKernel], config: ExecutorConfig, factory: KernelFactory
) -> tuple[Graph, list[OpKernel], dict[str, list[str]]]:
    """Step 3's delegates: each backend `config.segments` names plans on the graph the one
    before it left, in that order; the graph, its kernels and each backend's delegate nodes."""
    segments: dict[str, list[str]] = {}
    for name in config.segments:
        backend = segment_backend(name)  # ValueError naming the registered ones
        graph, made = backend.plan(graph, config)
        segments[name] = made
        if made:
            kernels = factory.create(graph)
            _check_delegates(graph, kernels, name, made)
    return graph, kernels, segments


def _check_delegates(
    graph: Graph, kernels: list[OpKernel], backend: str, names: list[str]
) -> None:
    """Every node `backend` says it made is in the graph with a Delegate as its target."""
    made = set(names)
    targets = {n.name: k.fn for n, k in zip(graph.nodes, kernels, strict=True) if n.name in made}
    for name in names:
        if name not in targets:
            raise TypeError(f"segment backend {backend!r} named {name}, a node the graph has not")
        if not isinstance(targets[name], Delegate):
            raise TypeError(
                f"segment backend {backend!r} made {name}, whose target "
                f"{type(targets[name]).__name__} is not a Delegate (it needs __call__, "
                "prepare_weights, aclose and statistics: asyncgraph/runtime/delegates.py)"
            )


def delegates_of(kernels: list[OpKernel]) -> tuple[Delegate, ...]:
    """The delegate nodes' targets (KernelKind.DELEGATE that satisfy the protocol): what a
    swap prepares and `aclose` closes."""
    return tuple(
        k.fn for k in kernels if k.kind is KernelKind.DELEGATE and isinstance(k.fn, Delegate)
    )


def _device_plan(
    graph: Graph,
    plan: ExecutionPlan,
    kernels: list[OpKernel],
    config: ExecutorConfig,
    driver: object | None,
) -> DevicePlan | None:
    """Step 5: the device plans, exactly when the program has device nodes (placement
    DEVICE), by the backend registered under their kernels' device type (imported only then)."""
    device_type = _device_type(graph, plan, kernels)
    if device_type is None:
        return None
    return device_backend(device_type).plan(graph, plan, kernels, config, driver)


def _device_type(graph: Graph, plan: ExecutionPlan, kernels: list[OpKernel]) -> str | None:
    """The one device type of the nodes placed DEVICE (None: there are none); a program on two
    device types is refused, naming a node of each (one device backend plans a program)."""
    first: dict[str, str] = {}  # device type -> its first node
    for node, kernel, where in zip(graph.nodes, kernels, plan.placement, strict=True):
        if where is Placement.DEVICE and kernel.device_type is not None:
            first.setdefault(kernel.device_type, node.name)
    if len(first) > 1:
        (a, a_node), (b, b_node) = list(first.items())[:2]
        raise ValueError(
            f"the program has nodes on device types {a!r} (node {a_node}) and {b!r} "
            f"(node {b_node}); one program runs on one device type"
        )
    return next(iter(first), None)
