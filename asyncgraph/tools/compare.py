"""Compare two program results leaf by leaf, and make inputs that fit a program's signature.

Used by `asyncgraph check` and the conformance tests. A comparison never stops at the first
difference: it returns one `LeafComparison` per output leaf (plus one for a structure mismatch),
so a report can show everything that differs. The rules:

- the pytree structures (containers, dict keys, registered dataclasses) must be equal;
- a tensor leaf must match in type, shape, dtype and device, then in values with
  torch.testing.assert_close(equal_nan=True) and its default tolerances for the dtype;
- any other leaf must have the same type and compare equal with == (NaN equals NaN).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree

from asyncgraph.graph.ir import Graph, InputKind, ScalarSpec, TensorSpec


@dataclass(frozen=True, slots=True)
class LeafComparison:
    """One output leaf: where it is, what each side holds, and why they differ ("" if equal)."""

    path: str
    expected: str
    actual: str
    problem: str = ""
    max_abs_diff: float | None = None

    @property
    def ok(self) -> bool:
        return not self.problem


def describe(value: Any) -> str:
    """A short description of a value: `Tensor f32[2, 3] cpu`, `int 3`, `None`."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        shape = ", ".join(str(d) for d in value.shape)
        kind = type(value).__name__
        return f"{kind} {dtype}[{shape}] {value.device}"
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def compare(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> list[LeafComparison]:
    """Compare `actual` with `expected` leaf by leaf; one record per leaf (see module doc)."""
    a_leaves, a_spec = pytree.tree_flatten_with_path(actual)
    e_leaves, e_spec = pytree.tree_flatten_with_path(expected)
    if a_spec != e_spec:
        return [
            LeafComparison(
                "<structure>",
                _spec_text(e_spec),
                _spec_text(a_spec),
                "output structure differs",
            )
        ]
    results = []
    for (path, a), (_, e) in zip(a_leaves, e_leaves, strict=True):
        results.append(compare_leaf(pytree.keystr(path) or "<output>", a, e, rtol=rtol, atol=atol))
    return results


def compare_leaf(
    path: str, actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None
) -> LeafComparison:
    """Compare one leaf (see the module docstring for the rules)."""
    want, got = describe(expected), describe(actual)
    if type(actual) is not type(expected):
        return LeafComparison(
            path, want, got,
            f"type: expected {type(expected).__name__}, got {type(actual).__name__}",
        )
    if not isinstance(expected, torch.Tensor):
        if actual == expected or _both_nan(actual, expected):
            return LeafComparison(path, want, got)
        return LeafComparison(path, want, got, f"value: expected {expected!r}, got {actual!r}")
    assert isinstance(actual, torch.Tensor)
    for attr in ("shape", "dtype", "device", "layout"):
        a, e = getattr(actual, attr), getattr(expected, attr)
        if a != e:
            return LeafComparison(path, want, got, f"{attr}: expected {e}, got {a}")
    diff = _max_abs_diff(actual, expected)
    try:
        torch.testing.assert_close(
            actual, expected, rtol=rtol, atol=atol, equal_nan=True, check_stride=False
        )
    except AssertionError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return LeafComparison(path, want, got, " ".join(lines[:3]), diff)
    return LeafComparison(path, want, got, "", diff)


def mismatches(results: list[LeafComparison]) -> list[LeafComparison]:
    return [r for r in results if not r.ok]


def assert_same(actual: Any, expected: Any, *, what: str = "outputs") -> None:
    """Raise AssertionError naming every leaf of `actual` that differs from `expected`."""
    bad = mismatches(compare(actual, expected))
    if bad:
        lines = [f"  {r.path}: {r.problem} (expected {r.expected}, got {r.actual})" for r in bad]
        raise AssertionError(f"{len(bad)} leaf/leaves of the {what} differ:\n" + "\n".join(lines))


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.numel() == 0:
        return None
    if a.dtype == torch.bool:
        return float((a != b).any())
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    try:
        d = (a.detach().to(torch.float64) - b.detach().to(torch.float64)).abs()
        d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
        return float(d.max())
    except (RuntimeError, TypeError):
        return None


def _spec_text(spec: pytree.TreeSpec) -> str:
    text = str(spec)
    return text if len(text) <= 60 else text[:57] + "..."


# -- inputs ------------------------------------------------------------------------------------


def random_inputs(
    graph: Graph, seed: int = 0, *, vary_dims: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random `(args, kwargs)` that fit the graph's signature (see random_flat_inputs)."""
    return structured_inputs(graph, random_flat_inputs(graph, seed, vary_dims=vary_dims))


def structured_inputs(
    graph: Graph, flat: list[Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Flat user inputs, in signature order, as the `(args, kwargs)` of a call."""
    in_spec = graph.signature.in_spec
    if in_spec is None:
        return tuple(flat), {}
    args, kwargs = pytree.tree_unflatten(flat, in_spec)
    return tuple(args), dict(kwargs)


def random_flat_inputs(graph: Graph, seed: int = 0, *, vary_dims: bool = False) -> list[Any]:
    """Random flat user inputs that fit the graph's signature, in signature order.

    Tensors get the exported example's sizes, or with `vary_dims` a size for every symbolic
    dimension drawn from its range (capped at twice the example size); dimensions that are
    expressions of symbols (`2*s0`) follow their symbols. Floats are standard normal, integers
    are in [0, 4) (small enough to be valid indices into most tables), bools are fair coins.
    Scalars fixed at export keep their value. Values a program accepts only within data-
    dependent limits (indices into a short table, say) may still be rejected by the model.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sig = graph.signature
    ranges = {str(k): v for k, v in sig.range_constraints.items()}
    bound: dict[str, int] = {}
    flat: list[Any] = []
    for spec_in in sig.inputs:
        if spec_in.kind is not InputKind.USER_INPUT:
            continue
        spec = graph.values[spec_in.value].spec
        if isinstance(spec, TensorSpec):
            shape = [
                _size(d, h, ranges, bound, rng, vary_dims)
                for d, h in zip(spec.shape, spec.hint, strict=True)
            ]
            flat.append(_random_tensor(shape, spec.dtype, spec.device, gen))
        elif isinstance(spec, ScalarSpec):
            flat.append(_random_scalar(spec, ranges, bound, rng))
        else:
            raise ValueError(
                f"input {spec_in.target}: no tensor spec or example value is recorded for it, "
                "so no random input can be made; pass the inputs yourself"
            )
    return flat


def _size(
    dim: Any,
    hint: int,
    ranges: Mapping[str, tuple[int, float]],
    bound: dict[str, int],
    rng: random.Random,
    vary: bool,
) -> int:
    if isinstance(dim, int):
        return dim
    if isinstance(dim, sympy.Symbol):
        return _symbol_value(dim, hint, ranges, bound, rng, vary)
    values = {}
    for sym in dim.free_symbols:
        values[sym] = _symbol_value(sym, None, ranges, bound, rng, vary)
    return int(dim.subs(values)) if values else hint


def _symbol_value(
    sym: Any,
    hint: int | None,
    ranges: Mapping[str, tuple[int, float]],
    bound: dict[str, int],
    rng: random.Random,
    vary: bool,
) -> int:
    name = str(sym)
    if name in bound:
        return bound[name]
    lo, hi = ranges.get(name, (0, math.inf))
    if hint is None or vary:
        base = hint if hint is not None else max(lo, 2)
        top = int(min(hi, max(base * 2, lo + 1)))
        value = rng.randint(max(int(lo), 1) if top >= 1 else int(lo), max(top, int(lo)))
    else:
        value = hint
    bound[name] = value
    return value


def _random_tensor(
    shape: list[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    elif dtype.is_complex:
        t = torch.randn(shape, generator=gen, dtype=dtype)
    else:
        t = torch.randint(0, 4, shape, generator=gen, dtype=torch.int64).to(dtype)
    return t.to(device)


def _random_scalar(
    spec: ScalarSpec,
    ranges: Mapping[str, tuple[int, float]],
    bound: dict[str, int],
    rng: random.Random,
) -> Any:
    if spec.fixed:
        return spec.value
    if spec.type is bool:
        return rng.random() < 0.5
    if spec.type is float:
        return rng.uniform(-2.0, 2.0)
    if spec.type is int:
        if isinstance(spec.expr, sympy.Symbol):
            return _symbol_value(spec.expr, None, ranges, bound, rng, True)
        return rng.randint(1, 4)
    raise ValueError(f"cannot make a random {spec.type.__name__}")
