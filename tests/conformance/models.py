"""The model corpus of the conformance tests: one small program per torch.export feature
of the support matrix (docs/support.md).

Each Case builds a module, the sequence of calls to make (the first is the export example; the
others vary values and, for dynamic programs, sizes), the dynamic shapes, and the higher-order
ops the exported program must contain, so a case cannot silently stop covering what it is for.
Custom ops live in the `agconf` namespace and are registered when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._higher_order_ops.associative_scan import associative_scan
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torch.export import Dim

from conformance.harness import TorchExportLimit
from tests.support import torchbind

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    name: str
    covers: str
    build: Callable[[], nn.Module]
    calls: Callable[[], list[Inputs]]
    dynamic_shapes: Any = None
    hops: frozenset[str] = frozenset()
    strict: bool = False
    decompose: bool = True
    seed: int = 0
    architecture: bool = False  # a real architecture: heavier, run on one event loop
    export_limit: TorchExportLimit | None = None  # torch versions that cannot export it
    skip: str | None = None  # why it cannot run here (a torch without torchbind's test class)
    # inputs that break a guard export recorded, and what the InputValidationError must say
    invalid: Callable[[], list[tuple[Inputs, str]]] | None = None


def g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=g(seed))


# -- custom ops (torch.library) ------------------------------------------------------------------

EFFECT_LOG: list[float] = []


@torch.library.custom_op("agconf::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("agconf::accumulate_", mutates_args=("acc",))
def accumulate_(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x)


@accumulate_.register_fake
def _(acc: torch.Tensor, x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("agconf::record", mutates_args=())
def record(x: torch.Tensor) -> torch.Tensor:
    """An effectful op: appends to EFFECT_LOG; the order of the log is the observable effect."""
    EFFECT_LOG.append(float(x.sum()))
    return x.clone()


@record.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


torch.library._register_effectful_op(
    "agconf::record", torch._library.effects.EffectType.ORDERED
)


# -- 1. higher-order ops -----------------------------------------------------------------------


class NestedCond(nn.Module):
    """cond inside cond, a data-dependent and a shape-dependent predicate, closed-over weight."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def inner_true(a: torch.Tensor) -> torch.Tensor:
            return self.lin(a).relu()

        def inner_false(a: torch.Tensor) -> torch.Tensor:
            return a.cos() - 1

        def outer_true(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cond(a.sum() > 0, inner_true, inner_false, (a,)) + b

        def outer_false(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * b

        return torch.cond(x.shape[0] > 2, outer_true, outer_false, (x, y))


class WhileCounter(nn.Module):
    """while_loop with a tensor counter, a carried tensor and an additional input."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def cond_fn(i: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
            return i < n

        def body_fn(i: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return i + 1, acc * 0.5 + x.sin()

        i, acc = while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x.clone()))
        return i, acc


class MapWithCond(nn.Module):
    """map over rows with a positional argument and a cond inside the body."""

    def forward(self, xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        def body(row: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.cond(row.sum() > 0, lambda r, w: r @ w, lambda r, w: r - 1, (row, w))

        return hop_map(body, xs, w)


class CumulativeScan(nn.Module):
    """scan: a running sum carry and a per-step output."""

    def forward(self, xs: torch.Tensor, init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def combine(carry: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nxt = carry + x
            return nxt, nxt * 2

        carry, ys = scan(combine, init, xs)
        return carry, ys


class GradAndAutocastRegions(nn.Module):
    """no_grad and autocast regions: wrap_with_set_grad_enabled and wrap_with_autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            y = self.lin(x) * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = torch.mm(y, y.t())
        return y, z


class AssociativeScan(nn.Module):
    """associative_scan (generic mode): exported as vmap calls, lowered by the importer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return associative_scan(lambda a, b: a * b + a, x, 0, combine_mode="generic")


class VmapProgram(nn.Module):
    """torch.vmap: pre-dispatch vmap-level calls that the importer lowers first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda r: r * r.sum())(x)


# -- 2. mutations ------------------------------------------------------------------------------


class CounterBuffer(nn.Module):
    """A buffer counter and a running mean: buffer mutations across sequential calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.mean.mul_(0.9).add_(x.mean(0) * 0.1)
        return x - self.mean


class InputMutation(nn.Module):
    """In-place updates of two user inputs (one inside a dict) and an output that reads them."""

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        x.mul_(2)
        state["h"].add_(x)
        return state["h"].sum() + x


class BatchNormTrain(nn.Module):
    """A conv net with batch norm in training mode: running stats are buffer mutations."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).relu()


# -- 3. symbolic shapes ------------------------------------------------------------------------


class SymbolicArithmetic(nn.Module):
    """sym_size arithmetic, a view on a computed size, torch._check, a dtype conversion."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        torch._check(n >= 2)
        flat = x.reshape(n * x.shape[1])
        z = torch.cat([flat, y.reshape(-1)])
        return z.to(torch.float64)[: n + y.shape[0]] * (n // 2)


class UnbackedItem(nn.Module):
    """An unbacked size from .item(), checked with torch._check and used to build a tensor."""

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        n = k.item()
        torch._check(n >= 0)
        torch._check(n <= x.shape[0])
        return x[:n].sum(0) + torch.ones(n).sum()


class NonzeroSizes(nn.Module):
    """A data-dependent output size (nonzero) and arithmetic on it."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.nonzero(x > 0)
        return idx, x[x > 0] * 2


# -- 4. effects and custom ops -----------------------------------------------------------------


class CustomOps(nn.Module):
    """A functional custom op and a custom op that mutates a buffer (auto_functionalized)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.agconf.scaled_tanh(x, 3.0)
        torch.ops.agconf.accumulate_(self.acc, y.sum(0))
        return y + self.acc


class Effects(nn.Module):
    """Effectful custom ops: with_effects and effect tokens keep their order."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.ops.agconf.record(x)
        b = torch.ops.agconf.record(y)
        c = torch.ops.agconf.record(a + b)
        return c


# -- 5. outputs --------------------------------------------------------------------------------


@dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


torch.export.register_dataclass(Pair, serialized_type_name="agconf.Pair")


class AliasedOutputs(nn.Module):
    """Outputs that are inputs, views of inputs, and views of each other."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = x + y
        return x, x.view(-1), y[0], z, z.t(), z


class ConstantOutputs(nn.Module):
    """Constant, None, float, bool and string-free scalar outputs beside a tensor."""

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        return x * 2, 3, None, 1.5, True


class SymIntOutputs(nn.Module):
    """Symbolic-int outputs (sizes of a dynamic input) and arithmetic on them."""

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        return x.shape[0], x.shape[0] * 2 + 1, x.sum()


class NestedPytrees(nn.Module):
    """Nested dict/list/tuple inputs and outputs, and a registered dataclass output."""

    def forward(self, inputs: dict[str, Any], scale: torch.Tensor) -> dict[str, Any]:
        a = inputs["a"]
        b, c = inputs["pair"]
        return {
            "sum": [a + b, (c * scale, None)],
            "pair": Pair(a.relu(), c.t()),
            "nested": {"x": (a, [b - 1])},
        }


class ParameterOutput(nn.Module):
    """A parameter and a buffer returned as they are."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, generator=g(5)))
        self.register_buffer("b", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w, self.b, x * self.w + self.b


# -- 6. script objects, more effects, guards beyond ranges, layouts, signature features ---------


class QueueMethods(nn.Module):
    """Stateful methods of a torchbind object passed in (call_torchbind, no effect tokens as
    exported; with_effects after run_decompositions): each result depends on their order."""

    def forward(self, tq: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tq.push(x * 2)
        first = tq.pop()
        second = tq.pop()
        third = tq.pop()
        return first - second * 3, torch.mm(x.unsqueeze(1), third.unsqueeze(0))


class QueueOps(nn.Module):
    """Operators taking a script object (`_TorchScriptTesting::queue_push/pop`)."""

    def forward(self, tq: Any, x: torch.Tensor) -> torch.Tensor:
        torch.ops._TorchScriptTesting.queue_push(tq, x.cos())
        a = torch.ops._TorchScriptTesting.queue_pop(tq)
        b = torch.ops._TorchScriptTesting.queue_pop(tq)
        return a * 10 - b


class QueueAttribute(nn.Module):
    """A torchbind object held by the module (a CUSTOM_OBJ constant). Each call leaves the queue
    as it found it, so calls on a shared program stay independent."""

    def __init__(self) -> None:
        super().__init__()
        self.tq = torchbind.tensor_queue() if torchbind.SKIP_REASON is None else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.tq.push(x + 1)
        self.tq.push(torch.mm(x, x))
        return self.tq.pop() * 2, self.tq.pop() - x


def _queue_calls(sizes: tuple[int, ...] = (3, 3, 3)) -> list[Inputs]:
    """Fresh queues of two tensors, and an x of each size."""
    if torchbind.SKIP_REASON is not None:
        return []
    return [((torchbind.tensor_queue(randn(3, seed=s), randn(3, seed=s + 1)),
              randn(n, seed=s + 2)), {}) for s, n in enumerate(sizes)]


class EffectsInterleaved(nn.Module):
    """Effectful ops on independent branches of uneven cost: only the effect token orders them."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.ops.agconf.record(torch.mm(x, x).sum(0))
        b = torch.ops.agconf.record(y * 2)
        c = torch.ops.agconf.record(x[0] - 1)
        return a + b + c


class ParityBranch(nn.Module):
    """Specialised on an even size (the issue's guard: x.size(0) % 2 == 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.size(0) % 2 == 0 else x * 0


class MultipleOfFour(nn.Module):
    """A dim declared as 4*k: sizes must be multiples of 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 4).sum(1)


class DerivedDims(nn.Module):
    """y's dim is x's minus one (Dim arithmetic)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x[1:] * y


class CheckedDivisible(nn.Module):
    """A runtime assert on an input size (torch._check), recorded as export guards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[0] % 3 == 0)
        return x.view(-1, 3).sum(1)


class SparseInput(nn.Module):
    """A sparse COO input (to_dense; core ATen: _to_dense, whose kernels are sparse-only)."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.to_dense(), w) + 1


class ChannelsLast(nn.Module):
    """A channels-last input: strided, but not contiguous."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(x.relu(), 2) + x.mean()


class KeywordsAndDefaults(nn.Module):
    """Keyword-only inputs, a None input, an optional input given and omitted, specialised
    int/float/bool scalars."""

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None, scale: float = 2.0,
                shift: int = 1, flip: bool = False) -> torch.Tensor:
        y = x * scale + shift
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return -y if flip else y


class ConstantsAndSharing(nn.Module):
    """A lifted tensor constant, a non-persistent buffer, and one weight used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.arange(4.0), persistent=False)
        self.table = torch.tensor([1.0, -1.0, 0.5, 2.0])  # a plain attribute: a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x) + self.offset) * self.table


class AutoDims(nn.Module):
    """Dim.AUTO dims, one of which export finds equal to another input's."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x @ y).softmax(-1)


def _sparse(seed: int, rows: int = 4) -> torch.Tensor:
    return randn(rows, 5, seed=seed).relu().to_sparse()


# -- real architectures ------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_key_padding_mask=mask)


class DecoderBlock(nn.Module):
    """A pre-norm decoder block: causal self-attention (SDPA), cross-attention, MLP."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.cross = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        h = self.ln2(x)
        x = x + self.cross(h, memory, memory, need_weights=False)[0]
        return x + self.mlp(self.ln3(x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class EmbeddingBagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 16, mode="mean")
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(32, 2)

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor, query: torch.Tensor
    ) -> torch.Tensor:
        pooled = self.bag(ids, offsets)
        q = self.emb(query).mean(1)
        return self.out(torch.cat([pooled, q], dim=-1))


class Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _eval(module: nn.Module) -> nn.Module:
    return module.eval()


# -- the corpus --------------------------------------------------------------------------------

batch = Dim("batch", min=1, max=64)

CASES: list[Case] = [
    Case(
        "nested_cond", "1: cond (nested, closed-over weight)", NestedCond,
        lambda: [((randn(4, 4, seed=s), randn(4, 4, seed=s + 9)), {}) for s in (0, 1)]
        + [((randn(2, 4), randn(2, 4, seed=3)), {}), ((randn(7, 4, seed=4), randn(7, 4)), {})],
        dynamic_shapes=({0: Dim("n", min=1, max=16)}, {0: Dim("n", min=1, max=16)}),
        hops=frozenset({"cond"}),
    ),
    Case(
        "while_counter", "1: while_loop", WhileCounter,
        lambda: [((randn(3, 2), torch.tensor(n)), {}) for n in (4, 0, 1, 7)],
        hops=frozenset({"while_loop"}),
    ),
    Case(
        "map_with_cond", "1: map_impl with cond inside", MapWithCond,
        lambda: [((randn(n, 3, seed=n), randn(3, 3, seed=1)), {}) for n in (5, 1, 9)],
        dynamic_shapes=({0: Dim("m", min=1, max=32)}, None),
        hops=frozenset({"map_impl", "cond"}),
    ),
    Case(
        "scan_cumulative", "1: scan", CumulativeScan,
        lambda: [((randn(6, 3, seed=s), randn(3, seed=s + 1)), {}) for s in (0, 1)],
        hops=frozenset({"scan"}),
    ),
    Case(
        "grad_and_autocast", "1: wrap_with_set_grad_enabled, wrap_with_autocast",
        GradAndAutocastRegions,
        lambda: [((randn(4, 8, seed=s),), {}) for s in (0, 1)],
        hops=frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast"}),
    ),
    Case(
        "associative_scan", "1: associative_scan (lowered through vmap)", AssociativeScan,
        lambda: [((randn(7, 3, seed=s),), {}) for s in (0, 1)],
    ),
    Case(
        "vmap", "1/6: pre-dispatch vmap levels", VmapProgram,
        lambda: [((randn(4, 5, seed=s),), {}) for s in (0, 1)],
    ),
    Case(
        "counter_buffer", "2: buffer mutations over sequential calls", CounterBuffer,
        lambda: [((randn(5, 4, seed=s),), {}) for s in range(4)],
    ),
    Case(
        "input_mutation", "2: user-input mutations (one inside a dict)", InputMutation,
        lambda: [((randn(3, seed=s), {"h": randn(3, seed=s + 5)}), {}) for s in range(3)],
    ),
    Case(
        "batchnorm_train", "2: batch norm running stats (train mode)", BatchNormTrain,
        lambda: [((randn(2, 3, 6, 6, seed=s),), {}) for s in range(3)],
    ),
    Case(
        "symbolic_arithmetic", "3: sym_size, symbolic arithmetic, _assert_scalar",
        SymbolicArithmetic,
        lambda: [((randn(n, 3, seed=n), randn(m, seed=m)), {})
                 for n, m in ((4, 2), (2, 5), (9, 1))],
        dynamic_shapes=({0: Dim("n", min=2, max=16)}, {0: Dim("m", min=1, max=16)}),
    ),
    Case(
        "unbacked_item", "3: unbacked symbol from .item()", UnbackedItem,
        lambda: [((randn(6, 3), torch.tensor(k)), {}) for k in (3, 0, 6)],
    ),
    Case(
        "nonzero_sizes", "3: data-dependent output sizes", NonzeroSizes,
        lambda: [((randn(4, 5, seed=s),), {}) for s in (0, 1)],
    ),
    Case(
        "custom_ops", "4: torch.library custom ops, auto_functionalized", CustomOps,
        lambda: [((randn(2, 3, seed=s),), {}) for s in range(3)],
    ),
    Case(
        "effects", "4: with_effects and effect tokens", Effects,
        lambda: [((randn(3, seed=s), randn(3, seed=s + 1)), {}) for s in range(2)],
    ),
    Case(
        "aliased_outputs", "5: outputs aliasing inputs and each other", AliasedOutputs,
        lambda: [((randn(2, 3), randn(2, 3, seed=1)), {})],
    ),
    Case(
        "constant_outputs", "5: constant, None, float and bool outputs", ConstantOutputs,
        lambda: [((randn(2),), {})],
    ),
    Case(
        "symint_outputs", "5: symbolic-int outputs", SymIntOutputs,
        lambda: [((randn(n, 2),), {}) for n in (3, 5, 8)],
        dynamic_shapes=({0: batch},),
    ),
    Case(
        "nested_pytrees", "5: nested dict/list/tuple, registered dataclass", NestedPytrees,
        lambda: [(({"a": randn(2, 2, seed=s), "pair": (randn(2, 2), randn(2, 2, seed=3))},
                   randn(2, 2, seed=4)), {}) for s in (0, 1)],
    ),
    Case(
        "parameter_output", "5: parameters and buffers as outputs", ParameterOutput,
        lambda: [((randn(3),), {})],
    ),
    Case(
        "transformer_encoder", "architecture: nn.TransformerEncoderLayer with padding mask",
        lambda: _eval(EncoderBlock()),
        lambda: [((randn(2, n, 32, seed=n), torch.arange(n).expand(2, n) >= n - 1), {})
                 for n in (6, 3)],
        dynamic_shapes=({1: Dim("t", min=2, max=64)}, {1: Dim("t", min=2, max=64)}),
        architecture=True,
        export_limit=TorchExportLimit(
            (2, 13), "torch 2.11's export emits the guard min(t, 4*t) == t for the padding "
            "mask's fast path and then finds it does not hold over t <= 64",
            r"Constraints violated \(t\)"),
    ),
    Case(
        "transformer_decoder", "architecture: decoder block, causal SDPA, cross-attention",
        lambda: _eval(DecoderBlock()),
        lambda: [((randn(2, n, 32, seed=n), randn(2, 5, 32, seed=1)), {}) for n in (7, 3)],
        dynamic_shapes=({1: Dim("t", min=2, max=64)}, None),
        architecture=True,
    ),
    Case(
        "convnet_bn_eval", "architecture: conv net with batch norm (eval)",
        lambda: _eval(ConvNet()),
        lambda: [((randn(n, 3, 16, 16, seed=n),), {}) for n in (2, 5)],
        dynamic_shapes=({0: batch},),
        architecture=True,
    ),
    Case(
        "embedding_bag", "architecture: EmbeddingBag + Embedding",
        lambda: _eval(EmbeddingBagModel()),
        lambda: [((torch.randint(0, 50, (10,), generator=g(s)), torch.tensor([0, 3, 7]),
                   torch.randint(0, 50, (3, 4), generator=g(s + 1))), {}) for s in (0, 1)],
        architecture=True,
    ),
    Case(
        "lstm", "architecture: 2-layer LSTM", lambda: _eval(Recurrent("lstm")),
        lambda: [((randn(3, 6, 8, seed=s),), {}) for s in (0, 1)],
        architecture=True,
    ),
    Case(
        "gru", "architecture: 2-layer GRU", lambda: _eval(Recurrent("gru")),
        lambda: [((randn(3, 6, 8, seed=s),), {}) for s in (0, 1)],
        architecture=True,
    ),
]

_NO_TORCHBIND = torchbind.SKIP_REASON

CASES += [
    Case(
        "torchbind_methods", "6: script object with stateful methods (call_torchbind)",
        QueueMethods, lambda: _queue_calls((3, 5, 2)),
        dynamic_shapes=(None, {0: Dim("q", min=2, max=8)}),
        hops=frozenset({"call_torchbind"}), skip=_NO_TORCHBIND,
    ),
    Case(
        "torchbind_ops", "6: operators taking a script object", QueueOps, _queue_calls,
        skip=_NO_TORCHBIND,
    ),
    Case(
        "torchbind_attribute", "6: a script object the module holds (CUSTOM_OBJ)",
        QueueAttribute, lambda: [((randn(3, 3, seed=s),), {}) for s in range(3)],
        hops=frozenset({"call_torchbind"}), skip=_NO_TORCHBIND,
    ),
    Case(
        "effects_interleaved", "6: effectful ops on independent branches (effect tokens)",
        EffectsInterleaved, lambda: [((randn(4, 4, seed=s), randn(4, seed=s + 1)), {})
                                     for s in range(3)],
    ),
    Case(
        "guard_parity", "6: a guard on divisibility (x.size(0) % 2 == 0)", ParityBranch,
        lambda: [((randn(n, seed=n),), {}) for n in (4, 2, 10)],
        dynamic_shapes=({0: Dim.DYNAMIC},),
        invalid=lambda: [(((torch.ones(5),), {}), r"^x\.shape\[0\] = 5 .*% 2 == 0")],
    ),
    Case(
        "guard_multiple_of", "6: a dim declared 4*k", MultipleOfFour,
        lambda: [((randn(n, seed=n),), {}) for n in (8, 12, 20)],
        dynamic_shapes=({0: 4 * Dim("k")},),
        invalid=lambda: [(((torch.ones(6),), {}), r"^x\.shape\[0\] = 6 \(Dim '4\*k'\)"),
                         (((torch.ones(4),), {}), r"^x\.shape\[0\] = 4 .*// 4 != 1")],
    ),
    Case(
        "guard_derived_dims", "6: derived dims (dy = dx - 1)", DerivedDims,
        lambda: [((randn(n, seed=n), randn(n - 1, seed=n + 1)), {}) for n in (5, 3, 9)],
        dynamic_shapes=({0: Dim("dx", min=3, max=32)}, {0: Dim("dx", min=3, max=32) - 1}),
        invalid=lambda: [(((torch.ones(5), torch.ones(5)), {}), r"^[xy]\.shape\[0\]"),
                         (((torch.ones(40), torch.ones(39)), {}), r"^[xy]\.shape\[0\]")],
    ),
    Case(
        "guard_runtime_assert", "6: torch._check on an input size", CheckedDivisible,
        lambda: [((randn(n, seed=n),), {}) for n in (9, 6, 15)],
        dynamic_shapes=({0: Dim.DYNAMIC},),
        invalid=lambda: [(((torch.ones(7),), {}), r"^x\.shape\[0\] = 7 .*% 3 == 0")],
    ),
    Case(
        "sparse_input", "6: a sparse COO input", SparseInput,
        lambda: [((_sparse(s), randn(5, 2, seed=s + 1)), {}) for s in range(3)],
    ),
    Case(
        "channels_last", "6: a channels-last input", ChannelsLast,
        lambda: [((randn(n, 3, 4, 4, seed=n).to(memory_format=torch.channels_last),), {})
                 for n in (2, 3, 5)],
        dynamic_shapes=({0: batch},),
    ),
    Case(
        "keywords_and_defaults", "6: keyword-only, None and specialised scalar inputs",
        KeywordsAndDefaults,
        lambda: [((randn(3, 4, seed=s),), {"mask": randn(3, 4, seed=s + 1) > 0, "scale": 2.0,
                                           "shift": 1, "flip": False}) for s in range(3)],
    ),
    Case(
        "constants_and_sharing", "6: lifted constant, non-persistent buffer, shared weight",
        ConstantsAndSharing, lambda: [((randn(n, 4, seed=n),), {}) for n in (2, 5, 3)],
        dynamic_shapes=({0: batch},),
    ),
    Case(
        "auto_dims", "6: Dim.AUTO", AutoDims,
        lambda: [((randn(n, 3, seed=n), randn(3, m, seed=m)), {}) for n, m in ((2, 4), (5, 3))],
        dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO}),
    ),
]

CASES_BY_NAME = {c.name: c for c in CASES}


def export_case(case: Case, decomposed: bool) -> torch.export.ExportedProgram:
    torch.manual_seed(case.seed)
    module = case.build()
    args, kwargs = case.calls()[0]
    ep = torch.export.export(
        module, args, kwargs, dynamic_shapes=case.dynamic_shapes, strict=case.strict
    )
    return ep.run_decompositions() if decomposed else ep
