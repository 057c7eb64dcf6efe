"""Control-flow higher-order ops whose subgraphs run on asyncgraph's own scheduler.

cond, while_loop, map_impl, scan, invoke_subgraph, run_const_graph, wrap_with_set_grad_enabled
and hints_wrapper carry their bodies as fx GraphModules among the node's arguments. At load time
every such GraphModule is imported into a Program and given its own inner Executor, which plans
it, places its nodes and may run independent nodes in parallel on its worker threads. At run
time the op's kernel is a coroutine (KernelKind.ASYNC, placed as a task on the loop) that awaits
inner executions in the order the op's eager semantics prescribe; the loop stays free while a
subgraph's heavy nodes run on workers.

What is called with what, and what is returned, follows the dense (eager) implementations in
torch/_higher_order_ops/, which the conformance tests compare against:

- cond(pred, true_fn, false_fn, operands): one branch, chosen by bool(pred).
- while_loop(cond_fn, body_fn, carried, additional): body until cond is false; carried inputs
  are cloned when the body never runs. while_loop_stack_output stacks every iteration's carry.
- map_impl(f, xs, pos_args): f on every row of xs, outputs stacked. Rows are independent, so
  they run concurrently, at most `max_concurrent_executions` at a time.
- scan(combine_fn, init, xs, additional): carry threaded through the rows, outputs stacked.
- invoke_subgraph(subgraph, identifier, *operands), run_const_graph(graph, args),
  hints_wrapper(body, args, kwargs, hints): the subgraph, once.
- wrap_with_set_grad_enabled(enabled, body, *args): the subgraph, once. Grad mode is not
  switched: it is thread-local and would leak into other tasks across an await, and it changes
  no value (asyncgraph runs for inference; no autograd graph is recorded).

Inner executors share nothing with the outer one but the event loop: each has its own frames
and (lazily started) worker threads. They are created with `config` (inputs are not validated
again: they come from the graph). `SubgraphKernel.aclose` closes them; an Executor that closes
its kernels' executors on aclose is the intended owner (see docs/support.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from asyncgraph.graph.importers import Program, from_graph_module
from asyncgraph.graph.ir import Node
from asyncgraph.kernels.base import (
    InnerExecutor,
    InnerExecutorFactory,
    KernelConfig,
    KernelKind,
    OpKernel,
)


class Subgraph:
    """One subgraph GraphModule, imported once and run on its own asyncgraph Executor."""

    __slots__ = ("executor", "name")

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        name: str,
        config: KernelConfig | None,
        make_executor: InnerExecutorFactory,
    ) -> None:
        imported = from_graph_module(gm)
        program = Program(imported.graph, imported.weights, name=name, reference=gm)
        self.name = name
        self.executor: InnerExecutor = make_executor(program, config)

    async def __call__(self, *args: Any) -> Any:
        """Run the subgraph; returns what `gm(*args)` returns (its output structure)."""
        return await self.executor.execute(*args)

    def __repr__(self) -> str:
        return f"<Subgraph {self.name}: {self.executor.plan.num_nodes} nodes>"


class SubgraphKernel:
    """The coroutine kernel of one higher-order-op node, holding the node's subgraphs.

    Subclasses implement `__call__` with the op's calling convention; the GraphModules they
    receive at run time are the node's constant arguments, mapped to their Subgraph by identity.
    """

    roles: tuple[str, ...] = ()  # names of the subgraph arguments, in order, for messages

    def __init__(
        self,
        op: Any,
        node: Node,
        config: KernelConfig | None,
        make_executor: InnerExecutorFactory | None,
    ) -> None:
        if make_executor is None:
            raise TypeError(
                f"%{node.name} ({getattr(op, '__name__', op)}): a control-flow kernel runs its "
                "subgraphs on inner executors; the KernelFactory has no inner_executor "
                "(the runtime sets one: asyncgraph/runtime/executor.py)"
            )
        self.op_name = str(getattr(op, "__name__", op))
        self.node_name = node.name
        self.subgraphs: dict[int, Subgraph] = {}
        for position, gm in enumerate(_graph_modules((node.args, node.kwargs))):
            if id(gm) in self.subgraphs:
                continue
            role = self.roles[position] if position < len(self.roles) else f"subgraph{position}"
            self.subgraphs[id(gm)] = Subgraph(gm, f"{node.name}.{role}", config, make_executor)

    def subgraph(self, gm: Any) -> Subgraph:
        try:
            return self.subgraphs[id(gm)]
        except KeyError:
            raise TypeError(
                f"%{self.node_name} ({self.op_name}): expected one of the node's subgraph "
                f"GraphModules, got {type(gm).__name__}"
            ) from None

    def executors(self) -> list[InnerExecutor]:
        """The inner executors, one per distinct subgraph (for statistics and tests)."""
        return [s.executor for s in self.subgraphs.values()]

    async def aclose(self) -> None:
        """Close the inner executors (their frames and worker threads)."""
        for sub in self.subgraphs.values():
            await sub.executor.aclose()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} %{self.node_name}: {list(self.subgraphs.values())}>"


class CondKernel(SubgraphKernel):
    roles = ("true_fn", "false_fn")

    async def __call__(
        self, pred: Any, true_fn: Any, false_fn: Any, operands: Sequence[Any]
    ) -> Any:
        branch = true_fn if bool(pred) else false_fn
        return await self.subgraph(branch)(*operands)


class WhileLoopKernel(SubgraphKernel):
    roles = ("cond_fn", "body_fn")
    stack_output = False

    async def __call__(
        self,
        cond_fn: Any,
        body_fn: Any,
        carried_inputs: Sequence[Any],
        additional_inputs: Sequence[Any],
        mutated_arg_indices: str = "",
    ) -> tuple[Any, ...]:
        cond, body = self.subgraph(cond_fn), self.subgraph(body_fn)
        if not isinstance(carried_inputs, (tuple, list)):
            raise RuntimeError(
                f"%{self.node_name}: carried_inputs must be a tuple or list, "
                f"got {type(carried_inputs).__name__}"
            )
        carried: tuple[Any, ...] = tuple(carried_inputs)
        extra = tuple(additional_inputs)
        pred = self._check_pred(await cond(*carried, *extra))
        if not pred:
            return tuple(
                (v.unsqueeze(0) if self.stack_output else v).clone()
                if isinstance(v, torch.Tensor) else v
                for v in carried
            )
        stacked: list[list[Any]] = [[] for _ in carried]
        while pred:
            out = await body(*carried, *extra)
            if not isinstance(out, tuple) or len(out) != len(carried):
                got = len(out) if isinstance(out, (tuple, list)) else type(out).__name__
                raise RuntimeError(
                    f"%{self.node_name}: body_fn must return a tuple of {len(carried)} "
                    f"carried values, got {got}"
                )
            if self.stack_output:
                for column, value in zip(stacked, out, strict=True):
                    column.append(value)
            carried = out
            pred = self._check_pred(await cond(*carried, *extra))
        if self.stack_output:
            return tuple(torch.stack(column, dim=0) for column in stacked)
        return carried

    def _check_pred(self, pred: Any) -> Any:
        if isinstance(pred, bool) or (
            isinstance(pred, torch.Tensor) and pred.dtype == torch.bool and pred.dim() == 0
        ):
            return pred
        raise RuntimeError(
            f"%{self.node_name}: cond_fn must return a boolean scalar tensor or a bool, "
            f"got {_describe(pred)}"
        )


class WhileLoopStackOutputKernel(WhileLoopKernel):
    stack_output = True


class MapKernel(SubgraphKernel):
    roles = ("body_fn",)

    async def __call__(self, f: Any, xs: Sequence[Any], pos_args: Sequence[Any]) -> Any:
        body = self.subgraph(f)
        flat_xs, spec = pytree.tree_flatten(xs)
        if not flat_xs or not all(isinstance(x, torch.Tensor) for x in flat_xs):
            raise RuntimeError(
                f"%{self.node_name}: the mapped inputs must be tensors, got "
                f"{[_describe(x) for x in flat_xs]}"
            )
        rows = flat_xs[0].shape[0]
        if any(x.shape[0] != rows for x in flat_xs):
            raise RuntimeError(
                f"%{self.node_name}: the mapped inputs must have the same leading size, got "
                f"shapes {[tuple(x.shape) for x in flat_xs]}"
            )
        if rows == 0:
            raise RuntimeError(
                f"%{self.node_name}: map over 0 rows has no output to stack "
                "(eager map_impl fails the same way)"
            )

        def row(i: int) -> Coroutine[Any, Any, Any]:
            sliced = pytree.tree_unflatten([x[i] for x in flat_xs], spec)
            return body(*sliced, *pos_args)

        window = body.executor.config.max_concurrent_executions  # the subgraph's executor's
        results = await _run_windowed(row, rows, window)
        return _stack_results(results, self.node_name)


class ScanKernel(SubgraphKernel):
    roles = ("combine_fn",)

    async def __call__(
        self,
        combine_fn: Any,
        init: Sequence[Any],
        xs: Sequence[Any],
        additional_inputs: Sequence[Any],
    ) -> Any:
        combine = self.subgraph(combine_fn)
        if len(xs) == 0:
            return init, []  # what eager generic_scan returns for no scanned inputs
        rows = xs[0].shape[0]
        n_carry = len(init)
        carry: Sequence[Any] = tuple(init)
        columns: list[list[Any]] | None = None
        for i in range(rows):
            out = pytree.tree_leaves(
                await combine(*carry, *[x.select(0, i) for x in xs], *additional_inputs)
            )
            carry, ys = tuple(out[:n_carry]), out[n_carry:]
            if columns is None:
                columns = [[] for _ in ys]
            for column, y in zip(columns, ys, strict=True):
                column.append(y)
        if columns is None:  # zero rows: eager cannot infer the outputs either
            raise RuntimeError(f"%{self.node_name}: scan over 0 rows has no output to stack")
        stacked = [
            torch.stack(c) if isinstance(c[0], torch.Tensor) else None for c in columns
        ]
        return (*carry, *stacked)


class InvokeSubgraphKernel(SubgraphKernel):
    roles = ("subgraph",)

    async def __call__(self, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        return await self.subgraph(subgraph)(*operands)


class RunConstGraphKernel(SubgraphKernel):
    roles = ("graph",)

    async def __call__(self, graph: Any, args: Sequence[Any]) -> Any:
        return await self.subgraph(graph)(*args)


class SetGradEnabledKernel(SubgraphKernel):
    roles = ("wrapped_func",)

    async def __call__(self, enable_grad: bool, wrapped_func: Any, *args: Any) -> Any:
        return await self.subgraph(wrapped_func)(*args)


class HintsWrapperKernel(SubgraphKernel):
    roles = ("body_fn",)

    async def __call__(
        self, body_fn: Any, args: Sequence[Any], kwargs: dict[str, Any], hints: Any
    ) -> Any:
        if kwargs:
            raise RuntimeError(
                f"%{self.node_name}: hints_wrapper with keyword arguments is not supported "
                f"(got {sorted(kwargs)})"
            )
        return await self.subgraph(body_fn)(*args)


class SubgraphHandler:
    """The higher-order handler of a control-flow op: like any handler `(op, node, config)`,
    and also given the KernelFactory's maker of inner executors (kernels/higher_order.py)."""

    __slots__ = ("cls",)

    def __init__(self, cls: type[SubgraphKernel]) -> None:
        self.cls = cls

    def __call__(
        self,
        op: Any,
        node: Node,
        config: KernelConfig | None,
        make_executor: InnerExecutorFactory | None = None,
    ) -> OpKernel:
        kernel = self.cls(op, node, config, make_executor)
        return OpKernel(kernel, KernelKind.ASYNC, f"higher_order.{kernel.op_name}")


def _handler(cls: type[SubgraphKernel]) -> SubgraphHandler:
    return SubgraphHandler(cls)


CONTROL_FLOW_KERNELS: dict[str, SubgraphHandler] = {
    "cond": _handler(CondKernel),
    "while_loop": _handler(WhileLoopKernel),
    "while_loop_stack_output": _handler(WhileLoopStackOutputKernel),
    "map_impl": _handler(MapKernel),
    "scan": _handler(ScanKernel),
    "invoke_subgraph": _handler(InvokeSubgraphKernel),
    "run_const_graph": _handler(RunConstGraphKernel),
    "wrap_with_set_grad_enabled": _handler(SetGradEnabledKernel),
    "hints_wrapper": _handler(HintsWrapperKernel),
}


# -- helpers -----------------------------------------------------------------------------------


def _graph_modules(obj: Any) -> Iterator[torch.fx.GraphModule]:
    """Every GraphModule inside a node's argument structure, in argument order."""
    if isinstance(obj, torch.fx.GraphModule):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _graph_modules(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _graph_modules(item)


async def _run_windowed(
    call: Callable[[int], Coroutine[Any, Any, Any]], count: int, window: int
) -> list[Any]:
    """`call(i)` for i in range(count), at most `window` at once; results in order.

    The first error cancels the rest of its window and is raised as itself (not wrapped in an
    ExceptionGroup), as eager's sequential loop would raise it.
    """
    results: list[Any] = []
    for start in range(0, count, max(1, window)):
        stop = min(count, start + max(1, window))
        if stop - start == 1:
            results.append(await call(start))
            continue
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(call(i)) for i in range(start, stop)]
        except BaseExceptionGroup as group_error:
            raise _first_error(group_error) from None
        results.extend(task.result() for task in tasks)
    return results


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_error(first) if isinstance(first, BaseExceptionGroup) else first


def _stack_results(results: list[Any], node_name: str) -> Any:
    """Stack per-row outputs leaf by leaf, as eager map's _stack_pytree does."""
    flat_rows = []
    spec = None
    for result in results:
        leaves, spec = pytree.tree_flatten(result)
        flat_rows.append(leaves)
    stacked: list[Any] = []
    for column in zip(*flat_rows, strict=True):
        if all(isinstance(v, torch.Tensor) for v in column):
            stacked.append(torch.stack(column))
        elif all(v is None for v in column):
            stacked.append(None)
        else:
            raise RuntimeError(
                f"%{node_name}: cannot stack map outputs {[_describe(v) for v in column][:4]}"
            )
    assert spec is not None
    return pytree.tree_unflatten(stacked, spec)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor({value.dtype}, shape={tuple(value.shape)})"
    return f"{type(value).__name__} {value!r}"
