"""Prim and structural ops: Python-level operations an exported graph contains.

They run in microseconds and touch no tensor data (or only check it), so they always run
inline wherever the scheduler is.
"""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any

import torch

_OPERATORS = [
    operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv,
    operator.floordiv, operator.mod, operator.pow, operator.neg, operator.pos, operator.abs,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    operator.and_, operator.or_, operator.xor, operator.not_, operator.invert,
    operator.lshift, operator.rshift, operator.truth,
]
_BUILTINS = [builtins.min, builtins.max, builtins.abs, builtins.int, builtins.float,
             builtins.bool, builtins.round, builtins.len, builtins.tuple, builtins.list]
_MATH = [math.ceil, math.floor, math.sqrt, math.trunc, math.log, math.exp]
_SYM = [getattr(torch, name) for name in (
    "sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sqrt",
    "sym_sum", "sym_fresh_size",
) if hasattr(torch, name)]


def make_tuple(*items: Any) -> tuple[Any, ...]:
    """Pack values into a tuple (the builder's structural op)."""
    return items


def make_list(*items: Any) -> list[Any]:
    """Pack values into a list (the builder's structural op)."""
    return list(items)


PRIM_FUNCTIONS: frozenset[Any] = frozenset(
    _OPERATORS + _BUILTINS + _MATH + _SYM + [make_tuple, make_list]
)

# aten ops that compute on sizes or only check metadata: no tensor data is produced.
PRIM_ATEN = frozenset({
    "aten::sym_size.int", "aten::sym_numel", "aten::sym_stride.int", "aten::sym_storage_offset",
    "aten::_assert_scalar", "aten::_assert_tensor_metadata", "aten::sym_constrain_range",
    "aten::sym_constrain_range_for_size", "aten::_assert_async.msg", "aten::_assert_async",
    "aten::sym_is_contiguous", "aten::_local_scalar_dense", "aten::scalar_tensor",
})
