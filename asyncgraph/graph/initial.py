"""initial_values: a graph's value list before its first node runs.

The interpreters that run a graph node by node on a list of its values (testing/reference.py's
ReferenceRunner, compiled/build.py's example values) start from the same list: the user
inputs, the weights by name and a fresh effect token in their slots. It lives here, in the
graph layer, so that every layer above can read it.

The Executor's frames start otherwise, on the hot path of every execution: they copy a
template that holds the weights, built once per weights version (runtime/weights.py), and
store the inputs and tokens into the plan's slots (runtime/frame.py's `load`), so that no
execution walks the signature or allocates a list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from asyncgraph.graph.ir import WEIGHT_KINDS, Graph, InputKind


def initial_values(
    graph: Graph, weights: Mapping[str, Any], inputs: Sequence[Any]
) -> list[Any]:
    """One slot per value of `graph`: the flat user `inputs`, each weight from `weights` by its
    name, a fresh token per effect token, and None for everything the nodes compute.

    Raises ValueError when `inputs` has not one value per user input, KeyError when a weight's
    name is not in `weights`.
    """
    values: list[Any] = [None] * len(graph.values)
    for spec, value in zip(graph.signature.user_inputs, inputs, strict=True):
        values[spec.value] = value
    for spec in graph.signature.inputs:
        if spec.kind in WEIGHT_KINDS:
            values[spec.value] = weights[spec.target or ""]
        elif spec.kind is InputKind.TOKEN:
            values[spec.value] = torch.empty(0)  # a fresh effect token per run
    return values
