"""InputValidator: check a call's inputs against the signature before any frame is taken.

nativert checks count, dtype and device. We check those, the pytree structure, and every static
or symbolic dimension against its range, binding each symbol on first sight so that two inputs
sharing a dimension must agree, then every guard export recorded that ep.module() checks
(divisible sizes, derived dims, specializations: Signature.guards). Messages name the input by
the user's path (the forward's parameter, a keyword's name, into structures: InputSpec.target)
and a dynamic dim by the user's `Dim` name where export kept it, and say expected versus
actual: `x.shape[1]: expected 64, got 32`, `x.shape[0]: expected a size in [1, 64]
(Dim 'batch'), got 100`. The names are worked out once, when the validator is made. All of
the checks run once per input signature (shapes, dtypes, scalar values): later calls with a
signature that passed cost one dict lookup.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import sympy
import torch
from torch.utils import _pytree as pytree

from asyncgraph.errors import InputValidationError
from asyncgraph.graph.ir import (
    Graph,
    InputGuard,
    InputKind,
    ScalarSpec,
    TensorSpec,
    ValueSpec,
    spec_children,
)

_MAX_PASSED = 256
_PLAIN_SCALARS = (int, float, bool, str, type(None))

Signature = tuple[Any, ...]
"""What validation depends on, per input: (type, shape, dtype, device) of a tensor, (type,
value) of a plain scalar. Equal signatures pass or fail alike; the Executor also hands it to
adaptive placement, whose shape key is a function of it."""


def signature_of(flat: Sequence[Any]) -> Signature | None:
    """What validation depends on, hashable; None when an input is neither a tensor nor a
    plain scalar (such calls are checked in full every time)."""
    parts: list[Any] = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append((type(x), x.shape, x.dtype, x.device))
        elif type(x) in _PLAIN_SCALARS:
            parts.append((type(x), x))
        else:
            return None
    return tuple(parts)


def _compile_guard(guard: InputGuard) -> Callable[[Sequence[Any]], bool]:
    """`guard.code` as a function of the flat inputs, in the namespace torch compiles
    ep.module()'s guards in; a guard that cannot be evaluated on an input counts as broken."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    namespace: dict[str, Any] = {**SYMPY_INTERP, "math": math, "inf": math.inf}
    fn = eval(compile(f"lambda args: {guard.code}", "<export guard>", "eval"), namespace)

    def holds(flat: Sequence[Any]) -> bool:
        try:
            return bool(fn(flat))
        except Exception:
            return False

    return holds


def _is_none(x: Any) -> bool:
    return x is None


_children = spec_children


def _keyword(key: Any) -> str:
    """A keyword argument as the user wrote it: `mask`, or `kwargs['a-b']`."""
    return key if isinstance(key, str) and key.isidentifier() else f"kwargs[{key!r}]"


def _call_signature(positional: list[str], keywords: list[str]) -> str:
    """`(x, y, *, scale)`: how a program is called."""
    return "(" + ", ".join(positional + (["*", *keywords] if keywords else [])) + ")"


class InputValidator:
    """Flattens `(args, kwargs)` by the input spec and checks every leaf."""

    def __init__(self, graph: Graph, max_unbounded_int: int = 1 << 24) -> None:
        self.max_unbounded_int = max_unbounded_int
        sig = graph.signature
        users = [s for s in sig.inputs if s.kind is InputKind.USER_INPUT]
        self.paths = [s.target or f"args[{i}]" for i, s in enumerate(users)]
        self.specs: list[ValueSpec | None] = [graph.values[s.value].spec for s in users]
        self.names = [graph.values[s.value].name for s in users]
        self.in_spec = sig.in_spec
        self.ranges = {str(k): v for k, v in sig.range_constraints.items()}
        self.count = len(users)
        self.guards = [(guard, _compile_guard(guard)) for guard in sig.guards]
        self.dim_names = sig.dim_names
        self.arg_names = sig.arg_names
        # the user's Dim name of each symbol export kept one for (Dim("batch") -> s77)
        self.symbol_names: dict[sympy.Expr, str] = {}
        self.where_names: dict[str, str] = {}  # "x.shape[0]" -> its Dim's name
        for (i, dim), name in sig.dim_names.items():
            spec = self.specs[i] if i < len(self.specs) else None
            if isinstance(spec, TensorSpec) and dim < len(spec.shape):
                self.where_names[f"{self.paths[i]}.shape[{dim}]"] = name
                want = spec.shape[dim]
                if isinstance(want, sympy.Symbol):
                    self.symbol_names.setdefault(want, name)
        # where each symbol first sizes an input ("x.shape[0]"): a dim's words when export kept
        # no name for it (a loaded .pt2 keeps none), rather than torch's internal "s45"
        self.symbol_sources: dict[sympy.Expr, str] = {}
        for path, spec in zip(self.paths, self.specs, strict=True):
            for dim, size in enumerate(spec.shape if isinstance(spec, TensorSpec) else ()):
                if isinstance(size, sympy.Symbol):
                    self.symbol_sources.setdefault(size, f"{path}.shape[{dim}]")
        self._passed: dict[tuple[Any, ...], None] = {}  # signatures of inputs that passed
        self._last: Signature | None = None  # the last of them: returned as the same object
        # Most programs take plain positional leaves: flatten those without pytree (~10 us).
        self.positional_leaves = False
        if self.in_spec is not None:
            args_spec, kwargs_spec = _children(self.in_spec)
            self.positional_leaves = kwargs_spec.num_children == 0 and all(
                child.is_leaf() for child in _children(args_spec)
            )

    # -- structure ---------------------------------------------------------------------------

    @property
    def passed_signatures(self) -> int:
        """How many input signatures are remembered as having passed (`check` skips the full
        check for inputs alike; at most _MAX_PASSED, then it starts afresh)."""
        return len(self._passed)

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The flat user inputs of a call, in signature order, or a structure error."""
        spec = self.in_spec
        if self.positional_leaves and not kwargs and len(args) == self.count:
            return list(args)
        positional, names = self._parameters()
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise InputValidationError(self._unexpected_keywords(unknown, positional, names))
        if len(args) != len(positional):
            raise InputValidationError(
                f"expected {len(positional)} positional argument(s), got {len(args)}; "
                f"the program takes {_call_signature(positional, names)}"
            )
        if spec is None:
            return list(args)
        missing = [k for k in names if k not in kwargs]
        if missing:
            raise InputValidationError(
                f"missing keyword argument(s) {', '.join(map(repr, missing))}; "
                f"the program takes {_call_signature(positional, names)}"
            )
        ordered = {k: kwargs[k] for k in names}
        flat, got = pytree.tree_flatten((tuple(args), ordered), is_leaf=_is_none)
        if got != spec:
            flat, got = pytree.tree_flatten((tuple(args), ordered))
        if got != spec:
            raise InputValidationError(self._structure_message(args, ordered, spec))
        return flat

    def _parameters(self) -> tuple[list[str], list[str]]:
        """The program's positional parameters (a leaf by its input's name, a structure by
        its path) and its keyword names, for messages about the call's shape."""
        if self.in_spec is None:
            return list(self.names), []
        args_spec, kwargs_spec = _children(self.in_spec)
        positional, leaf = [], 0
        for i, child in enumerate(_children(args_spec)):
            positional.append(self._arg_name(i) if not child.is_leaf() or self.arg_names
                              else self.names[leaf])
            leaf += child.num_leaves
        return positional, list(kwargs_spec.context or [])

    def _arg_name(self, i: int) -> str:
        """The i-th positional argument's name: the forward's parameter, or `args[i]`."""
        return self.arg_names[i] if i < len(self.arg_names) else f"args[{i}]"

    @staticmethod
    def _unexpected_keywords(unknown: list[str], positional: list[str], names: list[str]) -> str:
        text = (f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"the program takes {_call_signature(positional, names)}")
        by_position = [k for k in unknown if k in positional]
        if by_position:
            text += f": pass {', '.join(by_position)} by position"
        return text

    def _structure_message(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], spec: pytree.TreeSpec
    ) -> str:
        args_spec, kwargs_spec = _children(spec)
        pairs = [(self._arg_name(i), a, s) for i, (a, s) in
                 enumerate(zip(args, _children(args_spec), strict=False))]
        pairs += [(_keyword(k), kwargs[k], s) for k, s in
                  zip(kwargs_spec.context or [], _children(kwargs_spec), strict=False)]
        for path, value, expected in pairs:
            got = pytree.tree_structure(value, is_leaf=_is_none)
            if got != expected and pytree.tree_structure(value) != expected:
                return f"{path}: expected structure {expected}, got {got}"
        return f"inputs: expected structure {spec}"

    # -- leaves ------------------------------------------------------------------------------

    def check(self, flat: Sequence[Any]) -> Signature | None:
        """Check count, type, dtype, device and every dimension of the flat inputs; return
        their Signature (None when an input is neither a tensor nor a plain scalar).

        The outcome depends on nothing but the signature, so inputs like ones that passed
        before pass at once (a few hundred nanoseconds instead of a few microseconds).
        """
        if len(flat) != self.count:
            raise InputValidationError(f"expected {self.count} input(s), got {len(flat)}")
        key = signature_of(flat)
        last = self._last
        if key is not None and key == last:  # a repeat caller: no hashing, and the same
            return last  # object again, by which adaptive placement finds its entry at once
        if key is not None and key in self._passed:
            self._last = key
            return key
        self._check(flat)
        if key is not None:
            if len(self._passed) >= _MAX_PASSED:
                self._passed.clear()
            self._passed[key] = None
            self._last = key
        return key

    def _check(self, flat: Sequence[Any]) -> None:
        bound: dict[sympy.Expr, tuple[int, str]] = {}
        derived: list[tuple[str, str, sympy.Expr, int]] = []
        for path, spec, value in zip(self.paths, self.specs, flat, strict=True):
            if isinstance(spec, TensorSpec):
                self._check_tensor(path, spec, value, bound, derived)
            elif isinstance(spec, ScalarSpec):
                self._check_scalar(path, spec, value, bound)
        if derived:
            values = {sym: v for sym, (v, _) in bound.items()}
            for path, where, expr, got in derived:
                expected = expr.subs(values)
                if expected.free_symbols:
                    continue
                if int(expected) != got:
                    name = self.where_names.get(where)
                    dim = f"Dim {name!r} = " if name else "= "
                    raise InputValidationError(
                        f"{where}: expected {int(expected)} ({dim}{self._formula(expr, bound)}), "
                        f"got {got}",
                        path,
                    )
        for guard, holds in self.guards:
            if not holds(flat):
                raise self._guard_failed(guard, flat)

    def _guard_failed(self, guard: InputGuard, flat: Sequence[Any]) -> InputValidationError:
        """The error for a broken guard: the input and dim it reads first, by the user's name
        of the dim where export kept it, and the guard as ep.module() words it."""
        text = f"fails the guard {guard.text} the program was exported with"
        found = re.search(r"args\[(\d+)\]\.size\(\)\[(\d+)\]", guard.code)
        if found is not None:
            i, dim = int(found[1]), int(found[2])
            name = self.dim_names.get((i, dim))
            label = f" (Dim {name!r})" if name else ""
            return InputValidationError(
                f"{self.paths[i]}.shape[{dim}] = {flat[i].shape[dim]}{label} {text}",
                self.paths[i],
            )
        found = re.search(r"args\[(\d+)\]", guard.code)
        if found is None:
            return InputValidationError(f"the inputs {text}")
        i = int(found[1])
        return InputValidationError(f"{self.paths[i]} = {flat[i]!r} {text}", self.paths[i])

    def _check_tensor(
        self,
        path: str,
        spec: TensorSpec,
        value: Any,
        bound: dict[sympy.Expr, tuple[int, str]],
        derived: list[tuple[str, str, sympy.Expr, int]],
    ) -> None:
        if not isinstance(value, torch.Tensor):
            raise InputValidationError(
                f"{path}: expected a Tensor, got {type(value).__name__}", path
            )
        if value.dtype != spec.dtype:
            raise InputValidationError(
                f"{path}.dtype: expected {spec.dtype}, got {value.dtype}", path
            )
        want = spec.device
        if value.device.type != want.type or (
            want.index is not None and value.device.index != want.index
        ):
            raise InputValidationError(
                f"{path}.device: expected {spec.device}, got {value.device}", path
            )
        shape = value.shape
        if len(shape) != len(spec.shape):
            raise InputValidationError(
                f"{path}: expected {len(spec.shape)} dimension(s), got {len(shape)} "
                f"(shape {tuple(shape)})",
                path,
            )
        for axis, (want, got) in enumerate(zip(spec.shape, shape, strict=True)):
            where = f"{path}.shape[{axis}]"
            if isinstance(want, int):
                if want != got:
                    raise InputValidationError(f"{where}: expected {want}, got {got}", path)
            elif isinstance(want, sympy.Symbol):
                self._bind(path, where, want, got, bound)
            else:
                derived.append((path, where, want, got))

    def _check_scalar(
        self, path: str, spec: ScalarSpec, value: Any, bound: dict[sympy.Expr, tuple[int, str]]
    ) -> None:
        if spec.fixed:
            if spec.value is None:
                if value is not None:
                    raise InputValidationError(
                        f"{path}: expected None, got {type(value).__name__}", path
                    )
                return
            if type(value) is not spec.type or value != spec.value:
                raise InputValidationError(
                    f"{path}: expected {spec.value!r} (fixed when the program was exported), "
                    f"got {value!r}",
                    path,
                )
            return
        if not isinstance(value, spec.type) or (isinstance(value, bool) and spec.type is not bool):
            raise InputValidationError(
                f"{path}: expected {spec.type.__name__}, got {type(value).__name__}", path
            )
        if isinstance(spec.expr, sympy.Symbol):
            number = int(cast(Any, value))
            _, hi = self.ranges.get(str(spec.expr), (0, float("inf")))
            if hi == float("inf") and not 0 <= number <= self.max_unbounded_int:
                # an int without an upper bound sizes allocations inside kernels: cap it
                raise InputValidationError(
                    f"{path}: expected an int in [0, {self.max_unbounded_int}] "
                    f"(max_unbounded_int, as its exported range has no upper bound), "
                    f"got {number}",
                    path,
                )
            self._bind(path, path, spec.expr, number, bound)

    def _bind(
        self, path: str, where: str, sym: sympy.Symbol, got: int,
        bound: dict[sympy.Expr, tuple[int, str]],
    ) -> None:
        """Bind `sym` to the size `got` that `where` (a dim of input `path`, or the int input
        itself) has, checking its range on first sight and equality after."""
        name = self.symbol_names.get(sym)
        if sym in bound:
            value, first = bound[sym]
            if value != got:
                dim = f"Dim {name!r}: " if name else ""
                raise InputValidationError(
                    f"{where}: expected {value} ({dim}the same dimension as {first}), got {got}",
                    path,
                )
            return
        lo, hi = self.ranges.get(str(sym), (0, float("inf")))
        if not lo <= got <= hi and not (got in (0, 1) and lo <= 2 and hi == float("inf")):
            # Sizes 0 and 1 pass an unbounded range from 2, as ep.module() lets them: export
            # reports [2, inf] for a dimension it only assumed was not 0 or 1 (Dim.AUTO,
            # Dim.DYNAMIC: its 0/1 specialization), and the program runs at 1. A range the
            # user bounded (Dim("n", min=2, max=16)) is kept as written.
            upper = "inf" if hi == float("inf") else str(int(hi))
            if where == path:  # an int input
                raise InputValidationError(
                    f"{where}: expected an int in [{lo}, {upper}], got {got}", path
                )
            dim = f"Dim {name!r}" if name else \
                f"dynamic dim of {self.symbol_sources.get(sym, where)}"
            raise InputValidationError(
                f"{where}: expected a size in [{lo}, {upper}] ({dim}), got {got}", path
            )
        bound[sym] = (got, where)

    def _formula(self, expr: sympy.Expr, bound: dict[sympy.Expr, tuple[int, str]]) -> str:
        """A derived dim's expression in the user's words: each symbol by its Dim's name
        (`2*batch`), or else by the input dim that bound it (`y.shape[0] + 1`)."""
        names: dict[sympy.Basic, sympy.Basic] = {}
        for sym in expr.free_symbols:
            name = self.symbol_names.get(sym, "")
            if name.isidentifier():
                names[sym] = sympy.Symbol(name)
            elif sym in bound:
                names[sym] = sympy.Symbol(bound[sym][1])
        return str(expr.xreplace(names))
