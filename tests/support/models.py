"""The foundation's model corpus: small torch models that exercise the import and the executor.

Each case gives a model, example (args, kwargs) for export, dynamic shapes, and a function
making fresh inputs for a call (so calls differ from the export example).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import Dim

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def export_model(model: torch.nn.Module, x: torch.Tensor, dynamic: bool = False) -> Any:
    """`model` in eval mode exported on one input, dim 0 a dynamic batch (1-64) if asked."""
    shapes = ({0: torch.export.Dim("batch", min=1, max=64)},) if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), (x,), dynamic_shapes=shapes)


def eager_output(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What `model` gives on `x` in eval mode, without autograd: the reference."""
    with torch.no_grad():
        out: torch.Tensor = model.eval()(x)
        return out


class Chain(torch.nn.Module):
    """Ten aten nodes in a row after an embedding: one segment with weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for _ in range(3):
            h = torch.tanh(self.linear(h)) * 0.5 + h
        return h.sum(dim=-1)



class Affine(torch.nn.Module):
    """The served model of the HTTP tests: one Linear(4, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Scaled(torch.nn.Module):
    """`x @ (2 * W).t() + b`: the scaling and the transpose read only weights
    (constant folding takes them out of the graph; tests of folding and of swaps use it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 3))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w * 2).t() + self.b


@dataclass
class Case:
    name: str
    make_model: Callable[[], torch.nn.Module]
    make_inputs: Callable[[int], Inputs]
    dynamic_shapes: Any = None
    mutates: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def export(self) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
        torch.manual_seed(0)
        model = self.make_model().eval()
        args, kwargs = self.make_inputs(0)
        ep = torch.export.export(model, args, kwargs, dynamic_shapes=self.dynamic_shapes)
        return model, ep


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Tanh()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DeepMLP(torch.nn.Module):
    """`layers` x Linear(width)+ReLU: long enough (20 nodes) for a fast form of one segment."""

    def __init__(self, width: int = 32, layers: int = 10) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(m for _ in range(layers) for m in (
            torch.nn.Linear(width, width), torch.nn.ReLU())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 4, 3, stride=2)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.mean(dim=(2, 3)))


class TransformerBlock(torch.nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(hidden, 64), torch.nn.GELU(), torch.nn.Linear(64, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.ln1(x + a)
        return self.ln2(x + self.ff(x))


class SDPA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, 16)


class DictIO(torch.nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        s = inputs["a"] + inputs["b"]
        return {"sum": s, "prod": inputs["a"] * inputs["b"], "nested": [s.sin(), (s.cos(),)]}


class TupleIO(torch.nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, y = pair
        return x @ y, (x - 1).abs(), y.t()


class Kwargs(torch.nn.Module):
    def forward(
        self, x: torch.Tensor, *, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = x * scale
        if bias is not None:
            out = out + bias
        return out


class Counter(torch.nn.Module):
    """Mutates a buffer: every call adds the batch sum to a running total."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        self.calls.add_(1)
        return self.total * 2 + self.calls


class ScalarOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x.sum(), x.shape[0] * 2


class DynamicBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu() + y.view(x.shape[0], -1)


class InputMutation(torch.nn.Module):
    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(x)
        return acc * 2


class Branches(torch.nn.Module):
    """Four independent matmul branches joined at the end (a wide graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i in range(4):
            h = x
            for _ in range(3):
                h = torch.tanh(h @ self.w[i])
            outs.append(h)
        return torch.stack(outs).sum(0)


class EmbeddingBagModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(50, 8, mode="mean")
        self.out = torch.nn.Linear(8, 2)

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx, offsets))


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 1)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


batch = Dim("batch", min=1, max=32)

CASES: list[Case] = [
    Case("mlp", MLP, lambda s: ((_rand(4, 16, seed=s),), {})),
    Case("convnet", ConvNet, lambda s: ((_rand(2, 3, 16, 16, seed=s),), {})),
    Case(
        "transformer", TransformerBlock, lambda s: ((_rand(2, 6, 32, seed=s),), {}),
        dynamic_shapes=({0: batch},),
    ),
    Case("sdpa", SDPA, lambda s: ((_rand(2, 5, 16, seed=s),), {})),
    Case(
        "dict_io", DictIO,
        lambda s: (({"a": _rand(3, seed=s), "b": _rand(3, seed=s + 7)},), {}),
    ),
    Case("tuple_io", TupleIO, lambda s: (((_rand(3, 4, seed=s), _rand(4, 3, seed=s + 3)),), {})),
    Case(
        "kwargs", Kwargs,
        lambda s: (
            (_rand(2, 3, seed=s),), {"scale": _rand(3, seed=s + 1), "bias": _rand(3, seed=s)}
        ),
    ),
    Case("buffer_mutation", Counter, lambda s: ((_rand(5, 4, seed=s),), {}), mutates=True),
    Case("scalar_output", ScalarOut, lambda s: ((_rand(3, 2, seed=s),), {})),
    Case(
        "dynamic_batch", DynamicBatch,
        lambda s: ((_rand(3 + s % 4, 8, seed=s), _rand(3 + s % 4, 2, 4, seed=s)), {}),
        dynamic_shapes=({0: batch}, {0: batch}),
    ),
    Case(
        "input_mutation", InputMutation,
        lambda s: ((_rand(4, seed=s), torch.zeros(4)), {}), mutates=True,
    ),
    Case("branches", Branches, lambda s: ((_rand(8, 64, seed=s),), {})),
    Case(
        "embedding_bag", EmbeddingBagModel,
        lambda s: ((torch.randint(0, 50, (10,), generator=_g(s)), torch.tensor([0, 3, 7])), {}),
    ),
]

CASES_BY_NAME = {c.name: c for c in CASES}
