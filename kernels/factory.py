"""KernelFactory: maps every node of a graph to an OpKernel, or reports all that cannot be.

Like nativert's KernelFactory, this runs once at load time, so an unsupported op is an error
when the model is loaded — never in the middle of serving a request.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from asyncgraph.errors import UnsupportedOpsError
from asyncgraph.graph.ir import Graph, Node, TensorSpec
from asyncgraph.kernels.base import InnerExecutorFactory, KernelConfig, KernelKind, OpKernel
from asyncgraph.kernels.cost import estimate_cost
from asyncgraph.kernels.fast_bindings import fast_binding
from asyncgraph.kernels.higher_order import higher_order_kernel, is_higher_order
from asyncgraph.kernels.prim import PRIM_ATEN, PRIM_FUNCTIONS

_COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeImplicitAutograd",
                   "CompositeExplicitAutogradNonFunctional")
# The CPU's dispatch keys (a device's: `_keys_of`), of which one makes an aten op runnable
# there: its backend's, the composite ones, and those of the layouts. Ops such as
# aten._to_dense (core ATen's to_dense) have kernels only for the layouts they take: sparse,
# quantized, mkldnn, nested. Their node calls the operator, which dispatches on the actual
# inputs' keys, as ep.module() does; a strided input then fails in that node, named.
_DISPATCH_KEYS: dict[str, tuple[str, ...]] = {
    "cpu": ("CPU", *_COMPOSITE_KEYS,
            "SparseCPU", "SparseCsrCPU", "QuantizedCPU", "MkldnnCPU", "NestedTensorCPU"),
}


# Where a device type's dispatch keys come from (its backend's first: ("CUDA", "SparseCUDA",
# ...)): the runtime's device registry, set when the runtime is imported (runtime/device.py's
# DeviceKind.dispatch_keys). A device package brings them with its registration.
_DEVICE_KEYS: list[Callable[[str], tuple[str, ...]]] = []


def device_dispatch_keys(lookup: Callable[[str], tuple[str, ...]]) -> None:
    """Set where the dispatch keys of a device type come from (() for an unknown one, whose
    nodes then get CPU kernels)."""
    _DEVICE_KEYS[:] = [lookup]


def _keys_of(device_type: str) -> tuple[str, ...] | None:
    """The dispatch keys that make an aten op runnable on `device_type`; None when no device
    package registered it."""
    if device_type == "cpu":
        return _DISPATCH_KEYS["cpu"]
    keys = _DEVICE_KEYS[0](device_type) if _DEVICE_KEYS else ()
    return (keys[0], *_COMPOSITE_KEYS, *keys[1:]) if keys else None


# The maker of inner executors for factories made without one; the runtime sets it.
_DEFAULT_INNER: list[InnerExecutorFactory | None] = [None]


def default_inner_executor(make: InnerExecutorFactory) -> None:
    """Set the maker of control-flow subgraphs' executors for KernelFactory instances made
    without one (the runtime calls it when it is imported)."""
    _DEFAULT_INNER[0] = make


class KernelFactory:
    """Creates the kernels of a graph: aten, prim, higher-order, async and Python callables,
    and delegates (a callable whose `kernel_kind` is KernelKind.DELEGATE, such as a compiled
    AOTInductor segment: asyncgraph/compiled/delegate.py).

    `config` is the configuration the subgraphs of higher-order ops (cond, while_loop, map)
    run with on their own executors; None means ExecutorConfig's defaults. `inner_executor`
    makes those executors; the runtime passes it in, and gives the default for factories made
    without one (`default_inner_executor`, called by asyncgraph/runtime/executor.py), so the
    kernels never import the executor that imports them.
    """

    config: KernelConfig | None = None  # a class default: subclasses need not call __init__
    inner_executor: InnerExecutorFactory | None = None

    def __init__(
        self,
        config: KernelConfig | None = None,
        inner_executor: InnerExecutorFactory | None = None,
    ) -> None:
        self.config = config
        self.inner_executor = inner_executor

    def create(self, graph: Graph) -> list[OpKernel]:
        """One kernel per node, in node order; raises UnsupportedOpsError listing every gap."""
        kernels: list[OpKernel] = []
        missing: dict[str, list[str]] = {}
        for node in graph.nodes:
            try:
                kernel = self.kernel_for(node, graph)
            except UnsupportedOpsError as exc:  # a subgraph of a higher-order op has gaps
                for op in exc.ops:
                    missing.setdefault(op, []).append(f"{node.name} (in a subgraph)")
                continue
            if kernel is None:
                missing.setdefault(node.target_name(), []).append(node.name)
                continue
            kernels.append(kernel)
        if missing:
            lines = [f"  {op} (nodes: {', '.join(names)})" for op, names in missing.items()]
            raise UnsupportedOpsError(
                f"{len(missing)} op(s) of the graph have no kernel:\n" + "\n".join(lines),
                list(missing),
            )
        return kernels

    def kernel_for(self, node: Node, graph: Graph) -> OpKernel | None:
        """The kernel for one node, or None when there is none."""
        target: Any = node.target
        name = node.target_name()
        if isinstance(target, torch._ops.OpOverload):
            return self._aten(target, node, graph)
        if is_higher_order(target):
            return higher_order_kernel(
                target, node, self.config, self.inner_executor or _DEFAULT_INNER[0]
            )
        if getattr(target, "kernel_kind", None) is KernelKind.DELEGATE:  # a compiled segment
            return OpKernel(target, KernelKind.DELEGATE, name, int(getattr(target, "cost", 0)))
        if target in PRIM_FUNCTIONS:
            return OpKernel(target, KernelKind.PRIM, name)
        if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
            getattr(target, "__call__", None)  # noqa: B004 - async callable objects
        ):
            return OpKernel(target, KernelKind.ASYNC, name)
        if callable(target):
            return OpKernel(target, KernelKind.CPU, name, estimate_cost(node, graph))
        return None

    def _aten(self, op: torch._ops.OpOverload, node: Node, graph: Graph) -> OpKernel | None:
        schema_name = op._schema.name
        overload = (
            f"{schema_name}.{op._overloadname}" if op._overloadname != "default" else schema_name
        )
        fn: Any = getattr(op, "_op", op)  # the C++ callable: skips one Python frame per call
        if self.config is None or self.config.fast_bindings:  # the arg parser beats _op
            fn = fast_binding(op, node.kwargs) or fn
        if schema_name in PRIM_ATEN or overload in PRIM_ATEN:
            return OpKernel(fn, KernelKind.PRIM, str(op))
        device = _device_type(node, graph)
        keys = _keys_of(device or "cpu")
        if keys is None or not _has_kernel(op, keys):
            return None
        kind = KernelKind.CPU if device is None else KernelKind.DEVICE
        return OpKernel(fn, kind, str(op), estimate_cost(node, graph), device_type=device)


def _has_kernel(op: torch._ops.OpOverload, keys: tuple[str, ...]) -> bool:
    name: str = op._name  # op.name() is untyped in torch
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in keys):
        return True
    # Python-only kernels (torch.library in Python, py_impl) live on the OpOverload itself.
    return bool(getattr(op, "py_kernels", None)) or bool(getattr(op, "_py_kernels", None))


def _device_type(node: Node, graph: Graph) -> str | None:
    """The device type ("cuda") of a node's DEVICE kernel: that of the tensor it produces;
    for multi-output ops (no single output spec), of the first device tensor it reads. None
    for a CPU kernel, and for a device no package registered (its ops run as CPU
    kernels do, as before devices had kernels of their own)."""
    spec = graph.values[node.output].spec
    specs = [spec] if isinstance(spec, TensorSpec) else [
        graph.values[v].spec for v in node.inputs()]
    for s in specs:
        if (isinstance(s, TensorSpec) and s.device.type != "cpu"
                and _keys_of(s.device.type) is not None):
            return s.device.type
    return None
