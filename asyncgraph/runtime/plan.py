"""ExecutionPlan: everything about running a graph that can be computed once.

Built once per Executor (like nativert's ExecutionPlanner and ParallelGraphExecutor's
producers_), and shared read-only by every execution:

- `calls[i]`: node i compiled to a function of the frame's value list (generated code, so
  binding arguments costs one Python call instead of a walk over the argument structure);
- `users[i]`: the dataflow edges (schedule.py groups nodes into units and counts producers);
- `read_counts[v]`, `frees[i]`: how many nodes read value v, and which values node i may be
  the last reader of, so intermediates are dropped as soon as their last reader has run, in
  whatever order a parallel run takes;
- `placement[i]`: where node i runs (inline on the loop, on a worker thread, as a task, on a
  device: its kernel's `device_type` names the device backend that plans it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncgraph.graph.ir import WEIGHT_KINDS, Graph, InputKind, Node, OutputKind, Ref, iter_refs
from asyncgraph.kernels import KernelKind, OpKernel
from asyncgraph.runtime.config import ExecutorConfig


class Placement(enum.IntEnum):
    """Where a node runs. The scheduler has one handler per placement.

    DEVICE: enqueued on its device's queues (cuda/: a CUDA stream) by the device's unit
    tables. STREAM is a deprecated alias of DEVICE (the same member), kept for one release.
    """

    INLINE = 0
    WORKER = 1
    TASK = 2
    DEVICE = 3
    STREAM = 3  # deprecated alias of DEVICE
    # Only in a frame's unit table (runtime/device.py), never a node's placement: the unit's
    # node reads device values; the scheduler hands it off to await the device's events, then
    # runs it where its schedule places it.
    HOST_WAIT = 4


_HINTS = {"inline": Placement.INLINE, "worker": Placement.WORKER, "task": Placement.TASK}


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """The immutable, shared schedule of one graph (see the module docstring)."""

    num_values: int
    calls: tuple[Callable[[list[Any]], Any], ...]
    outputs: tuple[int, ...]
    users: tuple[tuple[int, ...], ...]
    read_counts: tuple[int, ...]
    frees: tuple[tuple[int, ...], ...]
    keep_output: tuple[bool, ...]
    retained: tuple[bool, ...]  # node's value is never freed: an output, or freeing is off
    placement: tuple[Placement, ...]
    user_input_slots: tuple[int, ...]
    token_slots: tuple[int, ...]
    weight_slots: tuple[tuple[int, str], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.calls)


def choose_placement(node: Node, kernel: OpKernel, config: ExecutorConfig) -> Placement:
    """Where a node runs, from its kernel's kind and estimated cost (see DESIGN.md)."""
    if kernel.kind is KernelKind.ASYNC:
        return Placement.TASK
    if node.placement_hint is not None:
        return _HINTS[node.placement_hint]
    if kernel.kind is KernelKind.PRIM:
        return Placement.INLINE
    if kernel.kind is KernelKind.DEVICE:
        return Placement.DEVICE
    if not isinstance(node.target, torch._ops.OpOverload) and kernel.cost == 0:
        return Placement.WORKER  # a Python callable of unknown cost: keep it off the loop
    return Placement.WORKER if kernel.cost >= config.heavy_op_flops else Placement.INLINE


def build_plan(graph: Graph, kernels: list[OpKernel], config: ExecutorConfig) -> ExecutionPlan:
    """Compute the plan of `graph` with one kernel per node."""
    users = graph.user_nodes()
    sig = graph.signature
    pinned = {spec.value for spec in sig.inputs if spec.kind in WEIGHT_KINDS}
    for out in sig.outputs:
        pinned.update(ref.id for ref in iter_refs(out.arg))
    read_counts = [0] * len(graph.values)
    frees: list[tuple[int, ...]] = []
    for node in graph.nodes:
        reads = node.inputs()
        for v in reads:
            read_counts[v] += 1
        can_free = config.free_values_after_use
        frees.append(tuple(v for v in reads if v not in pinned) if can_free else ())
    retained = tuple(
        n.output in pinned or not config.free_values_after_use for n in graph.nodes
    )
    keep_output = tuple(
        read_counts[n.output] > 0 or kept for n, kept in zip(graph.nodes, retained, strict=True)
    )

    return ExecutionPlan(
        num_values=len(graph.values),
        calls=compile_calls(graph, kernels),
        outputs=tuple(n.output for n in graph.nodes),
        users=tuple(tuple(u) for u in users),
        read_counts=tuple(read_counts),
        frees=tuple(frees),
        keep_output=keep_output,
        retained=retained,
        placement=tuple(
            choose_placement(n, k, config) for n, k in zip(graph.nodes, kernels, strict=True)
        ),
        user_input_slots=tuple(
            s.value for s in sig.inputs if s.kind is InputKind.USER_INPUT
        ),
        token_slots=tuple(s.value for s in sig.inputs if s.kind is InputKind.TOKEN),
        weight_slots=tuple(
            (s.value, s.target or "") for s in sig.inputs if s.kind in WEIGHT_KINDS
        ),
    )


def compile_calls(
    graph: Graph, kernels: list[OpKernel]
) -> tuple[Callable[[list[Any]], Any], ...]:
    """Generate `def n<i>(v): return fn(v[3], c0, [v[4]], dim=c1)` for every node.

    As torch.fx's codegen does for a whole graph, but per node: binding arguments becomes a
    single call with indexed loads instead of a recursive walk at every execution.
    """
    namespace: dict[str, Any] = {}
    lines: list[str] = []
    for node, kernel in zip(graph.nodes, kernels, strict=True):
        fn = f"f{node.index}"
        namespace[fn] = kernel.fn
        args = emit_args(node, namespace, _slot)
        lines.append(f"def n{node.index}(v):\n    return {fn}({args})\n")
    exec(compile("\n".join(lines), "<asyncgraph plan>", "exec"), namespace)
    return tuple(namespace[f"n{node.index}"] for node in graph.nodes)


def emit_args(node: Node, namespace: dict[str, Any], name: Callable[[Ref], str]) -> str:
    """The argument list of a call to `node`'s kernel as Python source; `name(ref)` writes a
    value read (a frame slot or a local), constants are bound in `namespace`."""
    emit = _Emitter(namespace, node.index, name)
    args = [emit(a) for a in node.args]
    args += [f"{k}={emit(v)}" for k, v in node.kwargs.items()]
    return ", ".join(args)


def _slot(ref: Ref) -> str:
    return f"v[{ref.id}]"


class _Emitter:
    """Writes an argument structure as a Python expression over the value list `v`."""

    def __init__(self, namespace: dict[str, Any], index: int, name: Callable[[Ref], str]) -> None:
        self.namespace = namespace
        self.index = index
        self.name = name
        self.count = 0

    def __call__(self, arg: Any) -> str:
        if isinstance(arg, Ref):
            return self.name(arg)
        if type(arg) is tuple and any(True for _ in iter_refs(arg)):
            return "(" + "".join(f"{self(a)}, " for a in arg) + ")"
        if type(arg) is list and any(True for _ in iter_refs(arg)):
            return "[" + ", ".join(self(a) for a in arg) + "]"
        if type(arg) is dict and any(True for _ in iter_refs(arg)):
            return "{" + ", ".join(f"{self._const(k)}: {self(v)}" for k, v in arg.items()) + "}"
        if type(arg) is list or type(arg) is dict:
            return f"{self._const(arg)}.copy()"  # kernels must not see another run's list
        return self._const(arg)

    def _const(self, value: Any) -> str:
        name = f"c{self.index}_{self.count}"
        self.count += 1
        self.namespace[name] = value
        return name


def output_refs(graph: Graph, kind: OutputKind) -> list[Any]:
    """The flat outputs of one kind: Refs, or constants returned as they are."""
    return [o.arg for o in graph.signature.outputs if o.kind is kind]
