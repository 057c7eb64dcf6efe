"""Higher-order ops (cond, while_loop, map, ...): a registry of handlers.

A handler turns a higher-order-op node into an OpKernel. The built-in handlers call the
operator's eager implementation with its subgraph modules, which is exact; running the
subgraphs on asyncgraph's own scheduler is the conformance issue's work. A higher-order op
without a handler is reported at load time with every other unsupported op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asyncgraph.kernels.base import KernelKind, OpKernel

HigherOrderHandler = Callable[[Any], OpKernel]

_HANDLERS: dict[str, HigherOrderHandler] = {}


def register_higher_order(name: str, handler: HigherOrderHandler) -> None:
    """Register `handler(op) -> OpKernel` for the higher-order op called `name`."""
    _HANDLERS[name] = handler


def higher_order_kernel(op: Any) -> OpKernel | None:
    """The kernel for higher-order op `op`, or None when no handler is registered."""
    handler = _HANDLERS.get(getattr(op, "__name__", ""))
    return handler(op) if handler is not None else None


def _eager(op: Any) -> OpKernel:
    return OpKernel(op, KernelKind.CPU, f"higher_order.{op.__name__}")


for _name in ("cond", "while_loop", "map_impl", "run_const_graph", "invoke_subgraph",
              "with_effects", "auto_functionalized", "auto_functionalized_v2", "scan",
              "associative_scan"):
    register_higher_order(_name, _eager)


def is_higher_order(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)
