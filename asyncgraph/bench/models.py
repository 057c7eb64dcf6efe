"""The workloads of the targets, as nn.Modules and the programs torch.export makes of them.

Exports are cached per process: exporting the 1,000-node chain takes seconds, and the
transformer is shared by three scenarios.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.export import ExportedProgram


class ReluChain(torch.nn.Module):
    """Target 1: `n` tiny ops in a row; almost all the time is per-node overhead."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.relu(x)
        return x


def encoder(hidden: int = 128, layers: int = 2, heads: int = 4, seed: int = 0) -> torch.nn.Module:
    """Target 2: a small transformer encoder (nn.TransformerEncoder, post-norm, no dropout)."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        hidden, heads, 4 * hidden, dropout=0.0, batch_first=True
    )
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


class MatmulChains(torch.nn.Module):
    """Target 3: independent chains of square matmuls (`lengths[i]` in chain i), stacked at
    the end. Equal lengths are the wide graph; one long chain among short ones the skewed."""

    def __init__(self, lengths: tuple[int, ...], dim: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # orthogonal-ish scaling keeps values O(1) through the chain
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5)
            for _ in range(sum(lengths))
        )
        self.lengths = lengths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        weights = iter(self.weights)
        for length in self.lengths:
            y = x
            for _ in range(length):
                y = torch.mm(y, next(weights))
            outs.append(y)
        return torch.stack(outs)


@functools.cache
def exported_chain(n: int, shape: tuple[int, ...]) -> tuple[torch.nn.Module, ExportedProgram]:
    model = ReluChain(n)
    return model, _export(model, torch.randn(shape))


@functools.cache
def exported_encoder(
    hidden: int, layers: int, seq: int, core_aten: bool, max_batch: int = 1
) -> tuple[torch.nn.Module, ExportedProgram]:
    """The encoder exported with torch.export.export; `core_aten` runs run_decompositions()
    as nativert's loaders do (about twice the nodes: views, permutes, addmm, bmm).
    `max_batch` > 1 exports dim 0 as a dynamic batch dimension up to that size (for
    dynamic batching); 1 exports batch 1 static."""
    model = encoder(hidden, layers)
    if max_batch > 1:
        batch = torch.export.Dim("batch", min=1, max=max_batch)
        ep = _export(model, torch.randn(2, seq, hidden), ({0: batch},))
    else:
        ep = _export(model, torch.randn(1, seq, hidden))
    if core_aten:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ep = ep.run_decompositions()
    return model, ep


@functools.cache
def exported_chains(
    lengths: tuple[int, ...], dim: int
) -> tuple[torch.nn.Module, ExportedProgram]:
    model = MatmulChains(lengths, dim).eval()
    return model, _export(model, torch.randn(dim, dim))


def _export(
    model: torch.nn.Module, x: torch.Tensor, dynamic_shapes: Any = None
) -> ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation
        return torch.export.export(model, (x,), dynamic_shapes=dynamic_shapes)


def call_nodes(ep: ExportedProgram) -> int:
    return sum(1 for n in ep.graph.nodes if n.op == "call_function")
