"""What a CUDA graph can capture: the pure predicate per node that graphs.py (whole
executions) and segments.py (segments) both ask, and the whole-execution plan
(`plan_capture`: capturable or not, with the reason), all without a GPU.

A node is capturable when it is a CUDA aten op that neither syncs the host nor has a
data-dependent output shape, draws no random numbers and mutates no argument (`DENIED` lists
the ops refused by name, and why); a host node is never in a capture, and one that reads a
GPU value is named as such.

Size arithmetic is the exception, for whole executions: a SCALAR node (`mul` of a
`sym_size`, a `floordiv`, a `sym_max`) whose every input is a function of the input
signature alone (sizes read by META nodes, plain scalar inputs, constants, other such
nodes: `signature_scalars`) computes the same value in every execution of a signature, and
executions are captured per signature. The capture runs it on the host, as the stream path
does, and the kernels it sizes are recorded with its value: a dynamic-batch export
(`reshape(x, [b * 2, -1])`) is captured whole, once per batch size (bucket). A scalar read
from GPU data (`.item()`, an unbacked size) still blocks the capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncgraph.cuda.streams import Role, StreamKey, StreamPlan, aten_names
from asyncgraph.graph.ir import Graph, OutputKind, Ref, TensorSpec, iter_refs
from asyncgraph.kernels import KernelKind, OpKernel
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.plan import ExecutionPlan

_SYNCS = "syncs the host (a data-dependent output shape)"
_HOST_READ = "reads a GPU value on the host"
_RANDOM = "draws random numbers (not captured: replays of random ops are not tested here)"

DENIED: dict[str, str] = {
    "aten::nonzero": _SYNCS,
    "aten::argwhere": _SYNCS,
    "aten::masked_select": _SYNCS,
    "aten::masked_scatter": _SYNCS,
    "aten::unique": _SYNCS,
    "aten::_unique": _SYNCS,
    "aten::_unique2": _SYNCS,
    "aten::unique_dim": _SYNCS,
    "aten::unique_consecutive": _SYNCS,
    "aten::unique_dim_consecutive": _SYNCS,
    "aten::where.default": _SYNCS,  # where(condition) is nonzero; where.self etc. are not
    "aten::bincount": _SYNCS,
    "aten::repeat_interleave.Tensor": _SYNCS,
    "aten::repeat_interleave.self_Tensor": _SYNCS,
    "aten::_local_scalar_dense": _HOST_READ,
    "aten::item": _HOST_READ,
    "aten::is_nonzero": _HOST_READ,
    "aten::equal": _HOST_READ,
    "aten::allclose": _HOST_READ,
    "aten::_assert_async": _HOST_READ,
    "aten::_assert_async.msg": _HOST_READ,
    "aten::bernoulli": _RANDOM,
    "aten::native_dropout": _RANDOM,
    "aten::rand": _RANDOM,
    "aten::rand_like": _RANDOM,
    "aten::randn": _RANDOM,
    "aten::randn_like": _RANDOM,
    "aten::randint": _RANDOM,
    "aten::randint_like": _RANDOM,
    "aten::randperm": _RANDOM,
    "aten::normal": _RANDOM,
    "aten::uniform": _RANDOM,
    "aten::exponential": _RANDOM,
    "aten::multinomial": _RANDOM,
}
"""aten ops never captured, and why: by name (every overload), or name.overload (that one;
the default overload spelled `name.default`)."""

# Ops that sync only with some arguments: the reason when the node's arguments do.
_SYNCS_WITH = "reads a GPU value on the host (with these arguments)"

_BOOL_INDEXED = frozenset({"aten::index.Tensor", "aten::index_put", "aten::_index_put_impl"})


def node_blocker(
    graph: Graph, index: int, role: Role, kernel: OpKernel, stream_plan: StreamPlan
) -> str | None:
    if role in (Role.SCALAR, Role.HOST):
        if stream_plan.host_waits[index] or any(
            stream_plan.roles[p] is Role.CUDA for p in producers(graph, index)
        ):
            return _HOST_READ
        return f"runs on the host (role {role.value})"
    if role is not Role.CUDA:
        return None  # ALIAS and META nodes run on the host, reading no GPU data
    node = graph.nodes[index]
    if kernel.kind is not KernelKind.DEVICE or kernel.device_type != "cuda":
        return f"is a {kernel.where} kernel"
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return "is a Python kernel, not an aten op"
    names = aten_names(target)
    assert names is not None
    for name in (f"{names[0]}.{target._overloadname}", names[0]):
        if name in DENIED:
            return DENIED[name]
    if target._schema.is_mutable:
        return "mutates its arguments"
    reason = _syncs_with_its_arguments(graph, index, names[1])
    if reason is not None:
        return reason
    for v in node.inputs():
        value = graph.values[v]
        spec = value.spec
        if isinstance(spec, TensorSpec) and spec.device.type != "cuda":
            return (
                f"reads {spec.device.type} tensor {value.name!r}: a graph would keep the value "
                "it had when captured"
            )
    if (names[1] in _BOOL_INDEXED or names[0] in _BOOL_INDEXED) and _reads_bool_tensor(
        graph, index
    ):
        return "indexes with a boolean mask " + _SYNCS.removeprefix("syncs the host ")
    return None


def _syncs_with_its_arguments(graph: Graph, index: int, name: str) -> str | None:
    """Ops that read a GPU value on the host only with some arguments:

    - `histc` with min == max (the default 0, 0) reads the input's min and max on the host;
    - `masked_fill.Tensor` with a 0-dim CUDA value reads the value on the host.
    """
    node = graph.nodes[index]
    if name == "aten::histc":
        low = node.kwargs.get("min", node.args[2] if len(node.args) > 2 else 0)
        high = node.kwargs.get("max", node.args[3] if len(node.args) > 3 else 0)
        if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low == high:
            return f"{_SYNCS_WITH}: histc with min == max reads the input's range"
        return None
    if name == "aten::masked_fill.Tensor":
        value = node.kwargs.get("value", node.args[2] if len(node.args) > 2 else None)
        if isinstance(value, Ref):
            spec = graph.values[value.id].spec
            if isinstance(spec, TensorSpec) and spec.device.type == "cuda":
                return f"{_SYNCS_WITH}: masked_fill with a CUDA value reads it on the host"
    return None


def _reads_bool_tensor(graph: Graph, index: int) -> bool:
    for v in graph.nodes[index].inputs()[1:]:
        spec = graph.values[v].spec
        if isinstance(spec, TensorSpec) and spec.dtype is torch.bool:
            return True
    return False


def producers(graph: Graph, index: int) -> list[int]:
    out = []
    for v in graph.nodes[index].inputs():
        producer = graph.values[v].producer
        if producer is not None:
            out.append(producer)
    return out


# -- the whole-execution capture plan ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CapturePlan:
    """Whether an Executor's executions are captured, and what capture needs.

    Attributes:
        capturable: every execution may be captured (after warm-up, per input signature).
        reason: why not, naming the first offending node, input or setting; None when it is.
        origin: the (device, stream) the graph is captured and replayed on.
        drops: per node, the frame slots no later node reads (freed during the capture, so
            the graph's pool can reuse their memory).
        produced_outputs: the frame slots of user outputs made by nodes: cloned per replay.
        inputs_out: a user input is also a user output: a replay hands the caller's tensor
            back as it came, not a copy out of the graph.
    """

    capturable: bool
    reason: str | None
    origin: StreamKey | None = None
    drops: tuple[tuple[int, ...], ...] = ()
    produced_outputs: tuple[int, ...] = ()
    inputs_out: bool = False

    def describe(self) -> str:
        """One line for `asyncgraph profile` and logs."""
        if self.capturable:
            return "captured as CUDA graphs (per input signature, after warm-up)"
        return f"not captured: {self.reason}"


def plan_capture(
    graph: Graph,
    plan: ExecutionPlan,
    stream_plan: StreamPlan,
    kernels: Sequence[OpKernel],
    config: ExecutorConfig,
) -> CapturePlan:
    """The CapturePlan of an Executor's graph (the graph that runs: after folding)."""
    reason = _blocker(graph, stream_plan, kernels, config)
    if reason is not None:
        return CapturePlan(False, reason)
    inputs = {s.value for s in graph.signature.user_inputs}
    return CapturePlan(
        True, None, stream_plan.streams_used[0], _drops(graph), _produced_outputs(graph),
        bool(inputs & _output_values(graph)),
    )


def _blocker(
    graph: Graph, stream_plan: StreamPlan, kernels: Sequence[OpKernel], config: ExecutorConfig
) -> str | None:
    """The first reason the program cannot be captured, or None."""
    if not config.cuda.graphs:
        return "cuda.graphs=False"
    if config.trace:
        return "trace=True records a span per node, which a replay does not have"
    sig = graph.signature
    for out in sig.outputs:
        if out.kind is OutputKind.BUFFER_MUTATION:
            return f"the program mutates buffer {out.target!r}: a replay would not update it"
        if out.kind is OutputKind.USER_INPUT_MUTATION:
            return f"the program mutates input {out.target!r}: a replay writes its static copy"
    for spec in sig.user_inputs:
        vspec = graph.values[spec.value].spec
        if isinstance(vspec, TensorSpec) and vspec.device.type != "cuda":
            return (
                f"input {spec.target!r} is a {vspec.device.type} tensor: a graph would keep "
                "the value it had when captured"
            )
    computed_per_signature = signature_scalars(graph, stream_plan.roles)
    for node, role, kernel in zip(graph.nodes, stream_plan.roles, kernels, strict=True):
        if node.index in computed_per_signature:
            continue  # size arithmetic: the same in every execution of the signature
        reason = node_blocker(graph, node.index, role, kernel, stream_plan)
        if reason is not None:
            return f"node {node.name!r} ({node.target_name()}) {reason}"
    devices = stream_plan.devices
    if len(devices) > 1:
        return f"CUDA nodes on devices {list(devices)}: one graph captures one device"
    return None


def signature_scalars(graph: Graph, roles: Sequence[Role]) -> frozenset[int]:
    """The SCALAR nodes whose value is a function of the input signature alone: each input
    is a constant, a plain scalar user input (its value is part of the signature), a size
    read by a META node, or the value of another such node (through ALIAS nodes too).

    Why they may be captured: a whole execution is captured per input signature
    (validation's `Signature`: shapes, dtypes, devices, scalar values), so such a node
    computes the same value at capture and in every execution that replays it; it runs on
    the host while the capture records, and the kernels it sizes are recorded with that
    value. A node reading anything else (a GPU value, a tensor on the host, a DENIED op such
    as `_local_scalar_dense`: a data-dependent size) is not one of them, nor is what it
    feeds. One pass in topological order."""
    user_scalars = {
        spec.value for spec in graph.signature.user_inputs
        if not isinstance(graph.values[spec.value].spec, TensorSpec)
    }
    of_signature: set[int] = set()  # values that are functions of the signature
    scalars: set[int] = set()
    for node, role in zip(graph.nodes, roles, strict=True):
        if role is Role.META:
            of_signature.add(node.output)
            continue
        if role not in (Role.SCALAR, Role.ALIAS) or _denied(node.target):
            continue
        if all(v in of_signature or v in user_scalars for v in node.inputs()):
            of_signature.add(node.output)
            if role is Role.SCALAR:
                scalars.add(node.index)
    return frozenset(scalars)


def _denied(target: object) -> bool:
    names = aten_names(target)
    if names is None:
        return False
    overload = getattr(target, "_overloadname", "default")
    return f"{names[0]}.{overload}" in DENIED or names[0] in DENIED


def _output_values(graph: Graph) -> set[int]:
    return {ref.id for out in graph.signature.outputs for ref in iter_refs(out.arg)}


def _drops(graph: Graph) -> tuple[tuple[int, ...], ...]:
    """Per node, the node-made values whose last reader it is (or that nobody reads), outputs
    excepted: dropped during the capture as the scheduler drops them."""
    outputs = _output_values(graph)
    last: dict[int, int] = {}
    for node in graph.nodes:
        last.setdefault(node.output, node.index)  # unread: dropped right after its node
        for v in node.inputs():
            last[v] = node.index
    drops: list[list[int]] = [[] for _ in graph.nodes]
    for value, reader in last.items():
        if graph.values[value].producer is not None and value not in outputs:
            drops[reader].append(value)
    return tuple(tuple(sorted(d)) for d in drops)


def _produced_outputs(graph: Graph) -> tuple[int, ...]:
    return tuple(
        sorted(v for v in _output_values(graph) if graph.values[v].producer is not None)
    )
