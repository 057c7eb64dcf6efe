"""Packed QKV: nn.MultiheadAttention's split of its in-projection runs as view + permute."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig

pytestmark = pytest.mark.usefixtures("leak_check")

aten = torch.ops.aten
UNSPLIT = ExecutorConfig(split_packed_qkv=False)
S, E, H = 6, 32, 4  # tokens, width, heads


def _export(model: torch.nn.Module, *args: Any, dynamic: Any = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), args, dynamic_shapes=dynamic)


def _encoder(batch_first: bool, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, 2 * E, dropout=0.0, batch_first=batch_first)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _targets(ex: Executor) -> list[Any]:
    return [n.target for n in ex.graph.nodes]


async def _same(ep: Any, x: torch.Tensor, split: int) -> Executor:
    """Run `ep` with and without the pass: `split` splits, the same numbers bit for bit."""
    async with Executor(ep) as ex, Executor(ep, UNSPLIT) as plain:
        assert (ex.qkv_splits, plain.qkv_splits) == (split, 0)
        for _ in range(5):  # past adaptive placement's profiling: the decided placement too
            out, ref = await ex.execute(x), await plain.execute(x)
            assert torch.equal(out, ref)
        torch.testing.assert_close(out, ep.module()(x))
        return ex


@pytest.mark.parametrize("batch_first", [True, False])
async def test_an_encoders_splits_become_views_bitwise_the_same(batch_first: bool) -> None:
    model = _encoder(batch_first)
    x = torch.randn(2, S, E) if batch_first else torch.randn(S, 2, E)
    ex = await _same(_export(model, x), x, split=2)
    targets = _targets(ex)
    assert aten.contiguous.default not in targets and aten.unflatten.int not in targets
    assert targets.count(aten.permute.default) >= 2
    selects = [n for n in ex.graph.nodes if n.target is aten.select.int]
    assert len(selects) == 6 and all(n.args[1:] in ((0, 0), (0, 1), (0, 2)) for n in selects)


async def test_a_core_aten_graph_splits_after_its_attention_is_recomposed() -> None:
    model, x = _encoder(True), torch.randn(2, S, E)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = _export(model, x).run_decompositions()
    ex = await _same(ep, x, split=2)
    targets = _targets(ex)
    assert aten.clone.default not in targets[:targets.index(aten.select.int)]
    assert ex.recomposed == 2


async def test_the_new_nodes_keep_the_names_of_the_nodes_they_replace() -> None:
    model, x = _encoder(True, layers=1), torch.randn(1, S, E)
    ep = _export(model, x)
    async with Executor(ep) as ex, Executor(ep, UNSPLIT) as plain:
        before = {n.name: n.target for n in plain.graph.nodes}
        after = {n.name: n.target for n in ex.graph.nodes}
        renamed = {name for name in after if before.get(name) is not after[name]}
        assert {before[name] for name in renamed} == {
            aten.unflatten.int, aten.contiguous.default, aten.view.default}
        assert sorted(after[name].__name__ for name in renamed) == [
            "permute.default", "select.int", "select.int", "select.int", "view.default"]
        await ex.execute(x)


class Split(torch.nn.Module):
    """The export of MultiheadAttention's split, written out; `leak` exposes one piece."""

    def __init__(self, leak: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(E, 3 * E)
        self.leak = leak

    def forward(self, x: torch.Tensor) -> Any:  # x: [S, B, E]
        s, b, _ = x.shape
        packed = self.proj(x)
        c = packed.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = (c[i].view(s, b * H, E // H).transpose(0, 1).view(b, H, s, E // H)
                   for i in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if self.leak == "packed":
            return out, c
        if self.leak == "head":
            return out + q.sum()
        return out


@pytest.mark.parametrize("leak, split", [("", 1), ("packed", 0), ("head", 0)])
async def test_a_piece_read_elsewhere_keeps_the_split(leak: str, split: int) -> None:
    model, x = Split(leak), torch.randn(S, 2, E)
    ep = _export(model, x)
    async with Executor(ep) as ex, Executor(ep, UNSPLIT) as plain:
        assert ex.qkv_splits == split
        out, ref = await ex.execute(x), await plain.execute(x)
        for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, ref)), strict=True):
            assert torch.equal(a, b)


async def test_attention_weights_are_left_alone() -> None:
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H)

    class Weights(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return mha(x, x, x, need_weights=True)

    x = torch.randn(S, 2, E)
    async with Executor(_export(Weights(), x)) as ex:
        assert ex.qkv_splits == 0  # the heads are read by bmm, not by attention
        out, _ = await ex.execute(x)
        torch.testing.assert_close(out, mha(x, x, x)[0])


async def test_a_dynamic_batch_splits_and_drops_the_unread_batch_product() -> None:
    model = _encoder(True)
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = _export(model, torch.randn(2, S, E), dynamic=({0: batch},))
    for rows in (1, 3):
        ex = await _same(ep, torch.randn(rows, S, E), split=2)
        views = [n for n in ex.graph.nodes if n.target is aten.view.default
                 and len(n.args[1]) == 5]
        assert [n.args[1] for n in views] == [[S, -1, 3, H, E // H]] * 2
        async with Executor(ep, UNSPLIT) as plain:
            # 17 nodes become 5 per layer; B*H (one `mul`, both layers read it) goes too
            assert len(plain.graph.nodes) - len(ex.graph.nodes) == 2 * (17 - 5) + 1
