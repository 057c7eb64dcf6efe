"""What a CUDA graph can capture, node by node: the pure predicate that graphs.py (whole
executions) and segments.py (segments) both ask, without a GPU.

A node is capturable when it is a CUDA aten op that neither syncs the host nor has a
data-dependent output shape, draws no random numbers and mutates no argument (`DENIED` lists
the ops refused by name, and why); a host node is never in a capture, and one that reads a
GPU value is named as such.
"""

from __future__ import annotations

import torch

from asyncgraph.cuda.streams import Role, StreamPlan, _aten_names
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.kernels import KernelKind, OpKernel

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
    "aten::where": _SYNCS,  # the one-argument overload is nonzero (where.self is listed apart)
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
"""aten ops (by name, or name.overload) never captured, and why."""

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
    if kernel.kind is not KernelKind.CUDA:
        return f"is a {kernel.kind.value} kernel"
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return "is a Python kernel, not an aten op"
    names = _aten_names(target)
    assert names is not None
    for name in (names[1], names[0]):
        if name in DENIED:
            return DENIED[name]
    if target._schema.is_mutable:
        return "mutates its arguments"
    if (names[1] in _BOOL_INDEXED or names[0] in _BOOL_INDEXED) and _reads_bool_tensor(
        graph, index
    ):
        return "indexes with a boolean mask " + _SYNCS.removeprefix("syncs the host ")
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
