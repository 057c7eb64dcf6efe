"""Higher-order ops (cond, while_loop, map, ...): a registry of handlers.

A handler turns one higher-order-op node into an OpKernel, once, at load time. It is given the
op, the node (whose arguments hold the subgraph GraphModules as constants, so a handler can
import them before the first request) and the ExecutorConfig the subgraphs should run with.

Two kinds of handlers are registered:

- control_flow.py: cond, while_loop, map_impl, scan, invoke_subgraph, run_const_graph,
  wrap_with_set_grad_enabled and hints_wrapper. Their subgraphs are imported into inner
  programs and run by asyncgraph's own scheduler (see that module).
- EAGER_REASONS below: ops that call their eager implementation, each with the reason it cannot
  (or need not) run node by node on the scheduler.

A higher-order op without a handler is reported at load time with every other unsupported op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asyncgraph.graph.ir import Node
from asyncgraph.kernels.base import InnerExecutorFactory, KernelConfig, KernelKind, OpKernel
from asyncgraph.kernels.control_flow import CONTROL_FLOW_KERNELS, SubgraphHandler

HigherOrderHandler = Callable[[Any, Node, KernelConfig | None], OpKernel]

_HANDLERS: dict[str, HigherOrderHandler] = {}


def register_higher_order(name: str, handler: HigherOrderHandler) -> None:
    """Register `handler(op, node, config) -> OpKernel` for the higher-order op `name`."""
    _HANDLERS[name] = handler


def higher_order_kernel(
    op: Any,
    node: Node,
    config: KernelConfig | None = None,
    make_executor: InnerExecutorFactory | None = None,
) -> OpKernel | None:
    """The kernel for higher-order op `op` at `node`, or None when no handler is registered.

    A control-flow handler also gets `make_executor`, which makes its subgraphs' executors."""
    handler = _HANDLERS.get(getattr(op, "__name__", ""))
    if handler is None:
        return None
    if isinstance(handler, SubgraphHandler):
        return handler(op, node, config, make_executor)
    return handler(op, node, config)


def eager_kernel(op: Any, node: Node, config: KernelConfig | None) -> OpKernel:
    """Call the op's eager implementation; a Python callable, so it runs on a worker thread."""
    return OpKernel(op, KernelKind.CPU, f"higher_order.{op.__name__}")


# Why these ops keep their eager implementation (docs/support.md repeats the table).
EAGER_REASONS: dict[str, str] = {
    "with_effects": (
        "not a subgraph: it calls one effectful op and returns a fresh effect token; the "
        "order of effects comes from the token's data edges, which the scheduler respects"
    ),
    "auto_functionalized": (
        "not a subgraph: it clones the arguments a custom op mutates and calls the op once"
    ),
    "auto_functionalized_v2": (
        "not a subgraph: it clones the bases a custom op mutates and calls the op once"
    ),
    "out_dtype": "not a subgraph: one aten op whose result is computed in another dtype",
    "call_torchbind": "not a subgraph: a method call on a TorchBind object",
    "wrap_with_autocast": (
        "autocast state is thread-local, while the scheduler may run a subgraph's nodes on the "
        "loop and on several workers; the eager implementation runs the whole subgraph on one "
        "thread inside the autocast region, which is the only way to get eager's dtypes"
    ),
    "associative_scan": (
        "the eager implementation applies combine_fn to whole halves of the input in a "
        "log-depth tree (vmapped); exported CPU programs are lowered to plain ops before they "
        "reach asyncgraph, so this handler is only a fallback"
    ),
    "flex_attention": (
        "score_mod and mask_mod are vmapped over the score matrix inside the op's math "
        "implementation; they are not standalone subgraph calls"
    ),
}

for _name, _handler in CONTROL_FLOW_KERNELS.items():
    register_higher_order(_name, _handler)
for _name in EAGER_REASONS:
    register_higher_order(_name, eager_kernel)


def is_higher_order(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)
