"""onnx_attention.py: self-attention blocks of a segment's fx graph as one call, used only
when the rewritten graph computes what the original does."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

from asyncgraph.compiled import onnx_attention
from asyncgraph.compiled.onnx_attention import TARGET, attention_fused

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _program(batch_first: bool, layers: int = 2) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The exported graph of `layers` encoder layers (weights are placeholders, as in a
    segment) and its arguments."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 32) if batch_first else torch.randn(5, 2, 32)
    ep = torch.export.export(model, (x,))
    weights = [ep.state_dict[s.target] for s in ep.graph_signature.input_specs
               if s.target is not None]
    return ep.graph_module, [*weights, x]


def _calls(module: torch.fx.GraphModule, target: Any) -> int:
    return len(module.graph.find_nodes(op="call_function", target=target))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch first", "sequence first"])
def test_each_block_becomes_one_call_that_computes_the_same(batch_first: bool) -> None:
    module, args = _program(batch_first)
    fused = attention_fused(module, args)
    assert fused is not module
    assert (_calls(fused, TARGET), _calls(fused, SDPA)) == (2, 0)
    (expected,), (actual,) = module(*args), fused(*args)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert _calls(module, SDPA) == 2  # the original is left as it was


def test_a_block_matched_wrongly_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """The match is structural; the rewritten graph is run beside the original on random
    inputs, and a rewrite that computes something else (here: 2 heads, not 4) is dropped."""
    block = onnx_attention._block

    def wrong_heads(sdpa: torch.fx.Node, values: Any) -> Any:
        found = block(sdpa, values)
        if found is None:
            return None
        rest = list(found.rest)
        rest[3] = 2  # num_heads
        return dataclasses.replace(found, rest=tuple(rest))

    monkeypatch.setattr(onnx_attention, "_block", wrong_heads)
    module, args = _program(True)
    with caplog.at_level(logging.DEBUG, logger="asyncgraph.onnx"):
        assert attention_fused(module, args) is module
    assert "the rewritten segment's outputs differ" in caplog.text


def test_a_graph_without_attention_is_returned_as_it_is() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    ep = torch.export.export(model, (x,))
    args = [*(ep.state_dict[s.target] for s in ep.graph_signature.input_specs
              if s.target is not None), x]
    assert attention_fused(ep.graph_module, args) is ep.graph_module


class _Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.encoder(x, mask=mask, is_causal=False)
        return out


def test_a_masked_block_is_left_alone() -> None:
    """ONNX Runtime's Attention takes masks in formats of its own: an SDPA given a mask stays
    as it is."""
    x, mask = torch.randn(2, 5, 32), torch.nn.Transformer.generate_square_subsequent_mask(5)
    ep = torch.export.export(_Masked().eval(), (x, mask))
    args = [*(ep.state_dict[s.target] for s in ep.graph_signature.input_specs
              if s.target is not None), x, mask]
    (sdpa,) = ep.graph_module.graph.find_nodes(op="call_function", target=SDPA)
    assert sdpa.args[3] is not None  # attn_mask
    ep.graph_module(*args)  # the arguments fit: the rewrite was not skipped for failing
    assert attention_fused(ep.graph_module, args) is ep.graph_module


class _SharedOutput(torch.nn.Module):
    """An attention block whose SDPA output is also read outside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, 4, 8).permute(2, 0, 3, 1, 4)
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out = self.out(heads.transpose(1, 2).reshape(batch, seq, 32))
        return out, heads.sum()


def test_a_block_whose_attention_output_is_read_elsewhere_is_left_alone() -> None:
    x = torch.randn(2, 5, 32)
    ep = torch.export.export(_SharedOutput().eval(), (x,))
    args = [*(ep.state_dict[s.target] for s in ep.graph_signature.input_specs
              if s.target is not None), x]
    assert attention_fused(ep.graph_module, args) is ep.graph_module
