"""The fast-binding table against the OpOverloads it replaces, op by op and on whole models.

Every entry must give the same result (values, dtype, shape, strides, aliasing) and reach the
same OpOverload (or the same decomposition) as `op._op`, for every argument form a graph can
pass: positional, omitted defaults, and any suffix of the arguments after `self` as keywords.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import asyncgraph
from asyncgraph import ExecutorConfig
from asyncgraph.kernels.fast_bindings import FAST_BINDINGS, fast_binding

pytestmark = pytest.mark.usefixtures("leak_check")

aten = torch.ops.aten
Sample = tuple[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]]


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000 * len(shape) + sum(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


def _pos(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _rand(*shape, dtype=dtype).abs() + 0.5  # for rsqrt, sqrt: no NaN


F32, F64, BF16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool
FLOATS = (F32, F64, BF16)


def _samples() -> Iterator[Sample]:
    x, y = _rand(8, 64), _rand(8, 64, seed=1)
    x3 = _rand(2, 8, 64)
    for dt in FLOATS:
        w, b = _rand(32, 64, dtype=dt), _rand(32, dtype=dt)
        yield aten.linear.default, (_rand(8, 64, dtype=dt), w, b), {}
        yield aten.linear.default, (_rand(2, 8, 64, dtype=dt), w), {}
        yield aten.linear.default, (_rand(64, dtype=dt), w, None), {}
        m1, m2 = _rand(8, 64, dtype=dt), _rand(64, 32, dtype=dt)
        yield aten.addmm.default, (b, m1, m2), {}
        yield aten.addmm.default, (_rand(8, 32, dtype=dt), m1, m2), {"beta": 0.5, "alpha": 2}
        yield aten._addmm_activation.default, (b, m1, m2), {}
        yield aten._addmm_activation.default, (b, m1, m2), {"use_gelu": True}
        yield aten.mm.default, (m1, m2), {}
        b1, b2 = _rand(3, 8, 64, dtype=dt), _rand(3, 64, 16, dtype=dt)
        yield aten.bmm.default, (b1, b2), {}
        yield aten.baddbmm.default, (_rand(3, 8, 16, dtype=dt), b1, b2), {}
        yield aten.baddbmm.default, (_rand(8, 16, dtype=dt), b1, b2), {"beta": 0, "alpha": 0.5}
        yield aten.matmul.default, (m1, m2), {}
        yield aten.matmul.default, (b1, m2), {}
        yield aten.matmul.default, (_rand(64, dtype=dt), m2), {}
        yield aten.matmul.default, (_rand(4, 1, 8, 64, dtype=dt), b2), {}
    yield aten.mm.default, (_rand(4, 5, dtype=I64), _rand(5, 3, dtype=I64)), {}

    # Binary elementwise: tensors of several dtypes, broadcasting, Python numbers, 0-dim.
    operands: list[tuple[Any, Any]] = [
        (x, y), (x, _rand(64)), (x3, x), (x, 2), (x, 2.5), (x, True),
        (_rand(8, 64, dtype=I64), 2.5), (_rand(8, 64, dtype=I64), _rand(64, dtype=I64)),
        (_rand(8, dtype=BF16), torch.tensor(3.0, dtype=F64)), (_rand(8, dtype=F64), x[0, :8]),
        (_rand(4, 4, dtype=BOOL), _rand(4, 4, dtype=BOOL, seed=1)), (x.t(), y.t()),
    ]
    for a, b_ in operands:
        yield aten.mul.Tensor, (a, b_), {}
        yield aten.div.Tensor, (a, b_), {}
        if a.dtype is not BOOL:
            yield aten.add.Tensor, (a, b_), {}
            yield aten.add.Tensor, (a, b_), {"alpha": 2}
            if not isinstance(b_, bool):
                yield aten.sub.Tensor, (a, b_), {}
                yield aten.sub.Tensor, (a, b_), {"alpha": 3}
    for mode in (None, "floor", "trunc"):
        yield aten.div.Tensor_mode, (x, y), {"rounding_mode": mode}
        yield aten.div.Tensor_mode, (_rand(9, dtype=I64), 4), {"rounding_mode": mode}
    yield aten.add.Tensor, (_rand(9, dtype=I64), _rand(9, dtype=I64)), {"alpha": 2}

    # Unary elementwise.
    for dt in FLOATS:
        xd, pd = _rand(4, 16, dtype=dt), _pos(4, 16, dtype=dt)
        for op in (aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.neg.default,
                   aten.exp.default, aten.sin.default, aten.cos.default, aten.abs.default,
                   aten.silu.default, aten.gelu.default, aten.logical_not.default):
            yield op, (xd,), {}
        yield aten.gelu.default, (xd,), {"approximate": "tanh"}
        yield aten.gelu.default, (xd,), {"approximate": "none"}
        yield aten.rsqrt.default, (pd,), {}
        yield aten.sqrt.default, (pd,), {}
    for op in (aten.relu.default, aten.neg.default, aten.abs.default, aten.logical_not.default):
        yield op, (_rand(4, 16, dtype=I64),), {}
    yield aten.logical_not.default, (_rand(4, 16, dtype=BOOL),), {}
    yield aten.sqrt.default, (_rand(4, dtype=I64).abs(),), {}
    yield aten.exp.default, (x.t(),), {}
    cond = _rand(8, 64, dtype=BOOL)
    yield aten.where.self, (cond, x, y), {}
    yield aten.where.self, (cond, x, _rand(64, dtype=F64)), {}
    yield aten.where.self, (cond[0], _rand(8, 1), torch.tensor(0.0)), {}
    scalar_operands: list[tuple[Any, Any]] = [
        (x, 0), (x, 0.5), (_rand(9, dtype=I64), 2), (_rand(9, dtype=I64), 2.5),
        (_rand(9, dtype=BOOL), True), (_rand(9, dtype=BF16), -1),
    ]
    for a, b_ in scalar_operands:
        for op in (aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar,
                   aten.gt.Scalar, aten.ge.Scalar):
            yield op, (a, b_), {}
        if a.dtype is not BOOL:
            yield aten.pow.Tensor_Scalar, (a, b_), {}

    # Softmax, normalisation, reductions.
    for dt in FLOATS:
        xd = _rand(4, 8, 16, dtype=dt)
        yield aten.softmax.int, (xd, -1), {}
        yield aten.softmax.int, (xd, 1, F64), {}
        yield aten._softmax.default, (xd, -1, False), {}
        yield aten._softmax.default, (xd, 0, False), {}
        w, b = _rand(16, dtype=dt), _rand(16, dtype=dt, seed=1)
        yield aten.layer_norm.default, (xd, [16], w, b, 1e-5), {}
        yield aten.layer_norm.default, (xd, [16]), {}
        yield aten.layer_norm.default, (xd, [8, 16], None, None, 1e-3, False), {}
        yield aten.native_layer_norm.default, (xd, [16], w, b, 1e-5), {}
        yield aten.native_layer_norm.default, (xd, [8, 16], None, None, 1e-6), {}
        for op in (aten.mean.dim, aten.sum.dim_IntList):
            yield op, (xd, [-1]), {}
            yield op, (xd, [0, 2], True), {}
            yield op, (xd, 1), {}
            yield op, (xd, None), {}
            yield op, (xd, [1], False), {"dtype": F64}
        yield aten.sum.default, (xd,), {}
        yield aten.sum.default, (xd,), {"dtype": F64}
        yield aten.amax.default, (xd, [1]), {}
        yield aten.amax.default, (xd, [0, 2], True), {}
        yield aten.amax.default, (xd,), {}
    yield aten.softmax.int, (_rand(4, 8, dtype=BF16), -1, F32), {}
    yield aten.sum.dim_IntList, (_rand(4, 8, dtype=I64), [1]), {}
    yield aten.sum.default, (_rand(4, 8, dtype=BOOL),), {}
    yield aten.sum.dim_IntList, (_rand(4, 8, dtype=I64), [0], True), {"dtype": F32}

    # Shapes and views, on contiguous and on non-contiguous inputs.
    xt = x.t()
    x4 = _rand(2, 3, 4, 5)
    for op, args in [
        (aten.view.default, (x, [64, 8])), (aten.view.default, (x, [-1])),
        (aten.view.default, (x, [2, 4, 64])), (aten.view.default, (xt, [64, 8])),
        (aten.view.default, (_rand(1), [])),
        (aten.reshape.default, (x, [4, -1])), (aten.reshape.default, (xt, [-1])),
        (aten.reshape.default, (x4, [6, 20])),
        (aten.permute.default, (x4, [3, 1, 0, 2])), (aten.permute.default, (x, [-1, 0])),
        (aten.transpose.int, (x, 0, 1)), (aten.transpose.int, (x4, -1, -3)),
        (aten.t.default, (x,)), (aten.t.default, (_rand(5),)),
        (aten.unsqueeze.default, (x, 0)), (aten.unsqueeze.default, (xt, -1)),
        (aten.squeeze.dim, (_rand(4, 1, 5), 1)), (aten.squeeze.dim, (x, 0)),
        (aten.squeeze.dim, (_rand(1, 4, 1), -1)),
        (aten.squeeze.dims, (_rand(1, 4, 1), [0, 2])), (aten.squeeze.dims, (x, [1])),
        (aten.squeeze.dims, (_rand(1, 4, 1), [-1])),
        (aten.select.int, (x, 0, 3)), (aten.select.int, (x4, -1, -2)),
        (aten.unflatten.int, (x, 1, [4, 16])), (aten.unflatten.int, (x, 0, [2, -1])),
        (aten.expand.default, (_rand(1, 64), [8, 64])),
        (aten.expand.default, (_rand(8, 1), [3, -1, 5])),
        (aten.clone.default, (x,)), (aten.clone.default, (xt,)),
        (aten.cat.default, ([x, y],)), (aten.cat.default, ([x, y, xt.t()], 1)),
        (aten.cat.default, ([x, _rand(2, 64, dtype=F64)], 0)),
        (aten.cat.default, ([_rand(0), x],)),
        (aten.stack.default, ([x, y],)), (aten.stack.default, ([x, y], -1)),
    ]:
        yield op, args, {}
    yield aten.expand.default, (_rand(1, 64), [8, 64]), {"implicit": True}
    for fmt in (torch.contiguous_format, torch.channels_last, torch.preserve_format):
        yield aten.clone.default, (x4.transpose(1, 3),), {"memory_format": fmt}
    yield aten.clone.default, (xt,), {"memory_format": None}

    # nn ops.
    weight, idx = _rand(10, 16), torch.tensor([[0, 2, 9], [4, 2, 0]])
    yield aten.embedding.default, (weight, idx), {}
    yield aten.embedding.default, (weight, idx, 2), {}
    yield aten.embedding.default, (weight, idx, -1, False, False), {}
    yield aten.dropout.default, (x, 0.1, False), {}
    yield aten.dropout.default, (x, 0.5, True), {}
    yield aten.dropout.default, (x, 0.0, True), {}
    for dt in (F32, F64):
        img, w, b = _rand(2, 3, 9, 9, dtype=dt), _rand(4, 3, 3, 3, dtype=dt), _rand(4, dtype=dt)
        yield aten.conv2d.default, (img, w, b), {}
        yield aten.conv2d.default, (img, w), {}
        yield aten.conv2d.default, (img, w, None, [2, 2], [1, 1], [1, 1], 1), {}
        yield aten.conv2d.default, (img, _rand(6, 1, 3, 3, dtype=dt), None, [1], [2], [2], 3), {}
        yield aten.convolution.default, (img, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}
        yield aten.convolution.default, (
            img, _rand(3, 4, 3, 3, dtype=dt), None, [2, 2], [1, 1], [1, 1], True, [1, 1], 1
        ), {}
        yield aten.max_pool2d.default, (img, [2, 2]), {}
        yield aten.max_pool2d.default, (img, [3, 3], [2, 2], [1, 1], [1, 1], True), {}
    q, k, v = _rand(2, 4, 8, 16), _rand(2, 4, 8, 16, seed=1), _rand(2, 4, 8, 16, seed=2)
    mask = _rand(8, 8) > 0
    sdpa = aten.scaled_dot_product_attention.default
    yield sdpa, (q, k, v), {}
    yield sdpa, (q, k, v, None, 0.0, True), {}
    yield sdpa, (q, k, v, mask), {}
    yield sdpa, (q, k, v, _rand(8, 8)), {"scale": 0.5}
    yield sdpa, (q, _rand(2, 2, 8, 16), _rand(2, 2, 8, 16, seed=1)), {"enable_gqa": True}
    yield sdpa, (q, k, v, None, 0.5, False), {}


SAMPLES: list[Sample] = list(_samples())


def _keyword_forms(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The sample with every suffix of its arguments after `self` moved to keywords."""
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]
    first = names.index("self") + 1 if "self" in names[: len(args)] else 0
    for split in range(len(args), first - 1, -1):
        moved = {names[i]: args[i] for i in range(split, len(args))}
        yield args[:split], {**moved, **kwargs}


class _Record(TorchDispatchMode):
    """Records every OpOverload that reaches the Python dispatch key."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _run(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
         ) -> tuple[Any, list[torch._ops.OpOverload]]:
    torch.manual_seed(0)  # dropout
    with _Record() as record:
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:  # the same error from both is a match too
            out = type(exc)
    return out, record.calls


def _assert_same(a: Any, b: Any, inputs: list[torch.Tensor]) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for ai, bi in zip(a, b, strict=True):
            _assert_same(ai, bi, inputs)
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (
            b.dtype, b.shape, b.stride(), b.storage_offset()
        )
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert a._is_view() == b._is_view()
        for t in inputs:  # the same aliasing of the inputs: a view stays a view of the same one
            assert (a is t) == (b is t)
            ptr = t.untyped_storage().data_ptr()
            a_ptr, b_ptr = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
            assert (a_ptr == ptr) == (b_ptr == ptr)
    else:
        assert a == b


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _composite(op: torch._ops.OpOverload) -> bool:
    key = "CompositeImplicitAutograd"
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key))


@pytest.mark.parametrize(
    "sample", SAMPLES, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(SAMPLES)]
)
@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_binding_matches_overload(sample: Sample, grad_mode: str) -> None:
    op, args, kwargs = sample
    binding = FAST_BINDINGS[op]
    inputs = _tensors((args, kwargs))
    guard = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    for f_args, f_kwargs in _keyword_forms(op, args, kwargs):
        assert fast_binding(op, f_kwargs) is binding
        with guard():
            expected, expected_calls = _run(op._op, f_args, f_kwargs)
            got, got_calls = _run(binding, f_args, f_kwargs)
        assert not isinstance(expected, type), f"the sample itself fails: {expected}"
        _assert_same(got, expected, inputs)
        assert got_calls == expected_calls
        if not _composite(op):
            assert expected_calls == [op]


def test_every_entry_is_sampled() -> None:
    sampled = {op for op, _, _ in SAMPLES}
    assert set(FAST_BINDINGS) <= sampled, set(FAST_BINDINGS) - sampled


def test_bindings_are_builtins() -> None:
    """C functions or method descriptors: a Python wrapper (torch.split) would cost a frame."""
    for op, binding in FAST_BINDINGS.items():
        assert isinstance(binding, (types.BuiltinFunctionType, types.MethodDescriptorType)), op


def test_self_keyword_and_unlisted_ops_keep_the_overload() -> None:
    assert fast_binding(aten.relu.default) is torch._C._VariableFunctions.relu
    assert fast_binding(aten.relu.default, {"self"}) is None
    assert fast_binding(aten.mul.Scalar) is None
    assert fast_binding(aten.add_.Tensor) is None


@pytest.mark.parametrize(("op", "binding", "args"), [
    (aten.mul.Scalar, torch._C._VariableFunctions.mul, (_rand(4), 2.0)),
    (aten.add.Scalar, torch._C._VariableFunctions.add, (_rand(4), 2.0)),
    (aten.div.Scalar, torch._C._VariableFunctions.div, (_rand(4), 2.0)),
    # Tensor.contiguous returns a contiguous input without dispatching at all.
    (aten.contiguous.default, torch._C.TensorBase.contiguous, (_rand(4),)),
])
def test_excluded_overloads_dispatch_elsewhere(
    op: torch._ops.OpOverload, binding: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    """Why these are out: the binding reaches another overload (.Tensor) or none."""
    _, calls = _run(binding, args, {})
    assert calls != [op]


# -- whole models through the executor -----------------------------------------------------------

def _encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.SiLU(),
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 8), torch.nn.Softmax(-1),
    ).eval()


@pytest.mark.parametrize("decompose", [False, True], ids=["export", "core_aten"])
@pytest.mark.parametrize("make", [_encoder, _mlp], ids=["encoder", "mlp"])
async def test_models_match_without_fast_bindings(
    make: Callable[[], torch.nn.Module], decompose: bool
) -> None:
    model = make()
    x = torch.randn(2, 16, 32)
    ep = torch.export.export(model, (x,))
    if decompose:
        ep = ep.run_decompositions()
    with torch.no_grad():
        expected = model(x)
    config = ExecutorConfig(adaptive_placement=False)
    async with asyncgraph.Executor(ep, config) as fast, asyncgraph.Executor(
        ep, ExecutorConfig(adaptive_placement=False, fast_bindings=False)
    ) as slow:
        used = {k.fn for k in fast.kernels} & set(FAST_BINDINGS.values())
        assert used, "no node of the model uses a fast binding"
        assert not {k.fn for k in slow.kernels} & set(FAST_BINDINGS.values())
        for seed in range(3):
            inp = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed))
            a = await fast.execute(copy.deepcopy(inp))
            b = await slow.execute(copy.deepcopy(inp))
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(await fast.execute(x), expected)
