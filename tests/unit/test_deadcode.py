"""Dead code (passes/deadcode.py): pure nodes nothing reads leave the graph; anything called
for an effect stays, read or not."""

from __future__ import annotations

import warnings

import torch

import asyncgraph
from asyncgraph.graph.ir import Graph
from asyncgraph.passes.deadcode import drop_dead_nodes


class UnreadPooler(torch.nn.Module):
    """A Hugging Face BERT's shape: a pooler (select, linear, tanh) nothing reads, beside a
    random draw nothing reads and a dtype check torch.export adds for `.to`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.pooler = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        torch.tanh(self.pooler(h[:, 0]))  # nothing reads it
        torch.rand_like(h)  # nothing reads it either, but it moves the generator
        return h * 2, mask.to(torch.bool)


def _graph() -> Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(UnreadPooler().eval(),
                                 (torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.int64)))
    return asyncgraph.to_program(ep).graph


def test_the_unread_pooler_goes_and_what_has_an_effect_stays() -> None:
    graph = _graph()
    names = [n.name for n in graph.nodes]
    assert {"select", "linear_1", "tanh", "rand_like"} <= set(names)
    pruned, dropped = drop_dead_nodes(graph)
    kept = [n.name for n in pruned.nodes]
    assert dropped == 3 and kept == [n for n in names if n not in {"select", "linear_1", "tanh"}]
    assert "rand_like" in kept  # a dropped draw would move the generator for later ones
    assert any(n.target is torch.ops.aten._assert_tensor_metadata.default
               for n in pruned.nodes)  # returns nothing: called for its check
    # the weights stay inputs of the program (a swap still names them)
    assert ([(s.kind, s.target) for s in pruned.signature.inputs]
            == [(s.kind, s.target) for s in graph.signature.inputs])


def test_a_graph_without_dead_code_is_returned_as_it_is() -> None:
    pruned, _ = drop_dead_nodes(_graph())
    again, dropped = drop_dead_nodes(pruned)
    assert again is pruned and dropped == 0
