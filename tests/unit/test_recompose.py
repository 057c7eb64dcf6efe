"""Recomposition: decomposed attention in a core-ATen graph runs as one fused SDPA node."""

from __future__ import annotations

import asyncio
import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.graph.importers import to_program
from asyncgraph.graph.ir import Graph, OutputKind, OutputSpec, Ref
from asyncgraph.passes.recompose import SDPA, recompose_attention

pytestmark = pytest.mark.usefixtures("leak_check")


class Attention(torch.nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal) * 2


def _core_aten(model: torch.nn.Module, *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), args).run_decompositions()


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))


def _targets(graph: Graph) -> list[Any]:
    return [n.target for n in graph.nodes]


async def test_decomposed_attention_becomes_one_sdpa_node() -> None:
    q, k, v = _qkv()
    ep = _core_aten(Attention(), q, k, v)
    assert SDPA not in [n.target for n in ep.graph.nodes]  # the math is decomposed
    async with Executor(ep) as ex, Executor(
        ep, ExecutorConfig(recompose_attention=False)
    ) as plain:
        assert ex.recomposed == 1 and _targets(ex.graph).count(SDPA) == 1
        assert len(ex.graph.nodes) < len(plain.graph.nodes) - 10
        assert plain.recomposed == 0 and SDPA not in _targets(plain.graph)
        for seed in range(3):
            inputs = _qkv(seed)
            torch.testing.assert_close(await ex.execute(*inputs), await plain.execute(*inputs),
                                       rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(await _run(ep, q, k, v), Attention()(q, k, v),
                                   rtol=1e-5, atol=1e-6)


async def _run(ep: Any, *args: Any) -> Any:
    async with Executor(ep) as ex:
        return await ex.execute(*args)


async def test_rows_whose_scores_are_all_minus_inf_stay_zero() -> None:
    """The decomposition zeroes rows of -inf scores; the fused kernel must agree."""
    q, k, v = _qkv()
    q = q.clone()
    k = -k.abs() - 0.1  # every key negative: a query row of +inf scores -inf everywhere
    q[0, 1, 2] = float("inf")
    ep = _core_aten(Attention(), *_qkv())
    async with Executor(ep) as ex, Executor(
        ep, ExecutorConfig(recompose_attention=False)
    ) as plain:
        assert ex.recomposed == 1
        fused, decomposed = await ex.execute(q, k, v), await plain.execute(q, k, v)
    torch.testing.assert_close(fused, decomposed, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.equal(decomposed[0, 1, 2], torch.zeros(8))


async def test_an_encoder_recomposes_each_layer() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(1, 6, 32)
    async with Executor(_core_aten(model, x)) as ex:
        assert ex.recomposed == 2
        out = await ex.execute(x)
    with torch.inference_mode():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


async def test_causal_attention_is_left_as_it_is() -> None:
    q, k, v = _qkv()
    ep = _core_aten(Attention(causal=True), q, k, v)
    async with Executor(ep) as ex:
        assert ex.recomposed == 0 and SDPA not in _targets(ex.graph)
        out = await ex.execute(q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(out, Attention(causal=True)(q, k, v), rtol=1e-5, atol=1e-6)


def test_an_intermediate_read_elsewhere_blocks_the_rewrite() -> None:
    """With the softmax also a graph output, the pattern's values are needed: no rewrite."""
    graph = to_program(_core_aten(Attention(), *_qkv())).graph
    assert recompose_attention(graph)[1] == 1
    softmax = next(n for n in graph.nodes if n.target is torch.ops.aten._softmax.default)
    extra = OutputSpec(OutputKind.USER_OUTPUT, Ref(softmax.output))
    sig = dataclasses.replace(graph.signature, outputs=(*graph.signature.outputs, extra),
                              out_spec=None)
    exposed = Graph(graph.values, graph.nodes, sig)
    assert recompose_attention(exposed) == (exposed, 0)


class CrossAttention(torch.nn.Module):
    """Keys and values longer than the queries, values narrower, an explicit scale."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=0.3)


async def test_cross_attention_with_its_own_scale_recomposes() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 7, 8, generator=g),
               torch.randn(2, 3, 7, 6, generator=g))
    async with Executor(_core_aten(CrossAttention(), q, k, v)) as ex:
        assert ex.recomposed == 1
        sdpa = next(n for n in ex.graph.nodes if n.target is SDPA)
        assert sdpa.kwargs["scale"] == pytest.approx(0.3)
        out = await ex.execute(q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(out, CrossAttention()(q, k, v), rtol=1e-5, atol=1e-6)


async def test_a_dynamic_batch_program_recomposes_and_batches() -> None:
    """Symbolic shapes (a dynamic batch) match as static ones do; batching runs on top."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = torch.export.export(model, (torch.randn(2, 6, 32),),
                                 dynamic_shapes=({0: batch},)).run_decompositions()
    xs = [torch.randn(1 + i % 3, 6, 32) for i in range(8)]
    config = ExecutorConfig(batching=BatchingConfig(max_batch_size=16))
    async with Executor(ep, config) as ex:
        assert ex.recomposed == 1
        outs = await asyncio.gather(*(ex.execute(x) for x in xs))
    with torch.inference_mode():
        for x, out in zip(xs, outs, strict=True):
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


def test_a_final_view_to_another_shape_blocks_the_rewrite() -> None:
    """SDPA gives [*q.shape[:-1], v.shape[-1]]: a pattern ending in any other view is not it."""
    graph = to_program(_core_aten(Attention(), *_qkv())).graph
    sdpa_graph, count = recompose_attention(graph)
    assert count == 1
    out = next(n for n in sdpa_graph.nodes if n.target is SDPA)
    last = graph.node(out.name.removesuffix("_sdpa"))  # the view the SDPA node replaced
    values = list(graph.values)
    spec = values[last.output].spec
    values[last.output] = dataclasses.replace(
        values[last.output], spec=dataclasses.replace(spec, shape=(6, 5, 8)),
    )
    reshaped = Graph(values, graph.nodes, graph.signature)
    assert recompose_attention(reshaped) == (reshaped, 0)
