"""Node targets: which names in a graph JSON resolve to operators the executor may call.

torch's deserialize_operator turns a node's `target` string into an object by walking
attributes from `torch`, `_operator` or `math`, any path at all (`torch.load`,
`torch.ops.load_library`), and the executor would call it. The same walk is done here, and only
operator objects (OpOverload, packets, higher-order operators) and a short list of arithmetic
and symbolic helpers that exported graphs call are allowed.

Two walks, because operator names are not attribute names:
- `torch.ops.<namespace>.<op>[.<overload>]` is looked up as torch's operator registry answers
  it, and the answer must be an operator object at each step. An operator's name may be a
  dunder: torch.export writes `&`, `|`, `^`, `<<`, `>>` on tensors as `aten.__and__.Tensor`
  and its kin, which every transformers attention mask uses.
- any other path is walked attribute by attribute without dunder steps (`torch.__builtins__`
  and the like are refused before they are reached).
"""

from __future__ import annotations

import math
import operator
from typing import Any

_UNRESOLVED = object()


def is_allowed_target(target: str) -> bool:
    """Whether a node may name `target`: an operator, or a name torch leaves unresolved (it
    stays a string, and the importer reports it as an unsupported op)."""
    resolved = _resolve_target(target)
    return resolved is _UNRESOLVED or _is_operator(resolved)


def _resolve_target(target: str) -> Any:
    """What torch's deserialize_operator turns `target` into, resolved the same way."""
    import torch

    if target.startswith("#"):
        return target  # an extension operator: refused (not an operator object)
    if target.startswith("torch.ops."):
        return _resolve_registered_operator(target)
    if target.startswith("_operator"):
        obj: Any = operator
    elif target.startswith("torch"):
        obj = torch
    elif target.startswith("math"):
        obj = math
    else:
        return _UNRESOLVED
    for part in target.split(".")[1:]:
        if part.startswith("__"):
            return target  # refused: no dunder walks
        if not hasattr(obj, part):
            return _UNRESOLVED
        obj = getattr(obj, part)
    return obj


def _resolve_registered_operator(target: str) -> Any:
    """`torch.ops.<namespace>.<op>[.<overload>]` as the registry resolves it: a namespace, then
    a packet or higher-order operator, then an overload. Anything else at a step (a method of
    torch.ops, a namespace's attribute) is refused by returning the target itself."""
    import torch

    parts = target.split(".")[2:]
    if not 2 <= len(parts) <= 3 or parts[0].startswith("__"):
        return target
    namespace_name, op_name, *overload = parts
    namespace = getattr(torch.ops, namespace_name, None)
    if not isinstance(namespace, (torch._ops._OpNamespace, torch._ops._HigherOrderNamespace)):
        return target
    try:
        op = getattr(namespace, op_name)
    except (AttributeError, RuntimeError):
        return _UNRESOLVED  # not registered here: the importer names it as unsupported
    if not isinstance(op, (torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return target
    if not overload:
        return op
    if overload[0].startswith("__") or isinstance(op, torch._ops.HigherOrderOperator):
        return target
    try:
        return getattr(op, overload[0])
    except (AttributeError, RuntimeError):
        return _UNRESOLVED


def _is_operator(obj: Any) -> bool:
    import torch

    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                        torch._ops.HigherOrderOperator)):
        return True
    return any(obj is f for f in _safe_functions())


def _safe_functions() -> list[Any]:
    """The plain functions exported graphs call as node targets, none of which runs code."""
    import torch

    fns: list[Any] = [
        getattr(operator, n) for n in (
            "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos",
            "abs", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert",
            "lshift", "rshift", "truth",
        )
    ]
    fns += [getattr(math, n) for n in ("ceil", "floor", "trunc", "sqrt", "log", "exp")]
    fns += [getattr(torch, n) for n in dir(torch) if n.startswith(("sym_", "_sym_"))]
    fns += [getattr(torch, n, None) for n in ("_check", "_check_is_size", "_assert")]
    fns.append(torch._C._set_grad_enabled)
    autocast = torch.amp.autocast_mode
    fns += [getattr(autocast, "_enter_autocast", None), getattr(autocast, "_exit_autocast", None)]
    return [f for f in fns if f is not None]
