"""Python bindings that run an aten op for less per call than its OpOverload.

`op._op` (an OpOverload's C++ callable) converts its arguments through the JIT's boxed
schema path (Python objects -> IValue stack -> boxed kernel); torch's generated Python
bindings (torch._C._VariableFunctions.relu, torch._C._nn.linear, Tensor.view) parse their
arguments with the python arg parser and call the unboxed op directly. For the small tensors of
an inline chain that is 0.3-1.5 us of a 1.5-5 us call.

A binding is listed only where it reaches exactly the same OpOverload (or, for a
CompositeImplicitAutograd op, the same decomposition) for every argument form an exported graph
uses: positional, omitted defaults, and the schema's own keyword names for every argument but
`self`, which the bindings call `input`. tests/unit/test_fast_bindings.py checks each entry against
its OpOverload with a dispatch-recording mode. Left out on purpose:

- ops whose binding picks another overload for the same Python arguments: add/sub/mul/div
  .Scalar (`torch.mul(x, 2.0)` reaches aten.mul.Tensor; the comparison .Scalar ops and
  pow.Tensor_Scalar do reach their own overload and are listed);
- contiguous: Tensor.contiguous returns a contiguous input without dispatching at all;
- ops whose binding returns a tuple where the OpOverload returns a list (split, unbind, ...);
- ops with no exact binding (_unsafe_view, slice.Tensor, _to_copy), in-place and out= ops.

One difference remains by design: a tensor subclass's __torch_function__ sees the binding
(`torch.relu`) as `func` instead of the OpOverload. Exported programs run on plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

# Each namespace's entries: aten overloads whose binding has the op's own name there.
_NAMESPACES: tuple[tuple[Any, tuple[str, ...]], ...] = (
    (torch._C._nn, (
        "linear.default", "gelu.default", "silu.default",
        "scaled_dot_product_attention.default",
    )),
    (torch._C.TensorBase, ("view.default", "expand.default")),
    (torch._C._VariableFunctions, (
        # matrix products
        "addmm.default", "_addmm_activation.default", "mm.default", "bmm.default",
        "matmul.default", "baddbmm.default",
        # elementwise
        "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "div.Tensor_mode",
        "relu.default", "tanh.default", "sigmoid.default", "rsqrt.default", "neg.default",
        "exp.default", "sqrt.default", "sin.default", "cos.default", "abs.default",
        "where.self", "logical_not.default", "pow.Tensor_Scalar", "eq.Scalar", "ne.Scalar",
        "lt.Scalar", "le.Scalar", "gt.Scalar", "ge.Scalar",
        # normalisation, softmax, reductions
        "softmax.int", "_softmax.default", "layer_norm.default", "native_layer_norm.default",
        "mean.dim", "sum.dim_IntList", "sum.default", "amax.default",
        # shapes and views
        "reshape.default", "permute.default", "transpose.int", "t.default",
        "unsqueeze.default", "squeeze.dim", "squeeze.dims", "select.int", "unflatten.int",
        "clone.default", "cat.default", "stack.default",
        # nn
        "embedding.default", "dropout.default", "conv2d.default", "convolution.default",
        "max_pool2d.default",
    )),
)


def _build() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    table: dict[torch._ops.OpOverload, Callable[..., Any]] = {}
    for namespace, overloads in _NAMESPACES:
        for overload in overloads:
            name, _, overload_name = overload.partition(".")
            packet = getattr(torch.ops.aten, name, None)
            op = getattr(packet, overload_name, None) if packet is not None else None
            binding = getattr(namespace, name, None)
            if op is not None and binding is not None:  # both exist in this torch version
                table[op] = binding
    return table


FAST_BINDINGS: dict[torch._ops.OpOverload, Callable[..., Any]] = _build()
"""aten OpOverload -> the Python binding that dispatches to it; the verified table."""


def fast_binding(
    op: torch._ops.OpOverload, kwarg_names: Collection[str] = ()
) -> Callable[..., Any] | None:
    """The Python binding to call instead of `op._op`, or None to keep `op._op`.

    `kwarg_names` are the keywords the node passes; the bindings name the schema's `self`
    argument `input` (or take it positionally only), so a node passing `self=` keeps `_op`.
    """
    binding = FAST_BINDINGS.get(op)
    if binding is None or "self" in kwarg_names:
        return None
    return binding
