"""The leaf-by-leaf comparison and the random inputs that `check` and the corpus rely on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.export import Dim

from asyncgraph.graph.importers import to_program
from asyncgraph.tools.compare import assert_same, compare, describe, random_inputs


def test_equal_structures_compare_ok() -> None:
    value = {"a": [torch.ones(2), None, 3], "b": (1.5, float("nan"), torch.tensor([float("nan")]))}
    results = compare(value, value)
    paths = ["['a'][0]", "['a'][1]", "['a'][2]", "['b'][0]", "['b'][1]", "['b'][2]"]
    assert [r.path for r in results] == paths
    assert all(r.ok for r in results)


@pytest.mark.parametrize(
    ("actual", "expected", "problem"),
    [
        (torch.ones(2), torch.ones(3), "shape"),
        (torch.ones(2, dtype=torch.float64), torch.ones(2), "dtype"),
        (torch.ones(2) + 1e-2, torch.ones(2), "not close"),
        (torch.ones(2, dtype=torch.int64) + 1, torch.ones(2, dtype=torch.int64), "not equal"),
        (2, 3, "value"),
        (2.0, 2, "type"),
        (True, 1, "type"),
        (torch.ones(()), 1.0, "type"),
    ],
)
def test_each_kind_of_difference_is_named(actual: object, expected: object, problem: str) -> None:
    (result,) = compare([actual], [expected])
    assert not result.ok
    assert problem in result.problem.lower(), result.problem
    assert result.path == "[0]"


def test_structure_difference() -> None:
    (result,) = compare({"a": 1}, {"b": 1})
    assert result.path == "<structure>" and not result.ok
    (result,) = compare((1, 2), [1, 2])
    assert not result.ok


@dataclass
class _Point:
    x: torch.Tensor


torch.export.register_dataclass(_Point, serialized_type_name="agconf.test_compare.Point")


def test_registered_dataclasses_are_compared_by_field() -> None:
    results = compare(_Point(torch.ones(2)), _Point(torch.zeros(2)))
    assert [r.path for r in results] == [".x"]
    assert not results[0].ok


def test_assert_same_lists_every_mismatch() -> None:
    with pytest.raises(AssertionError, match=r"2 leaf/leaves of the outputs differ") as info:
        assert_same([torch.ones(1), 1, torch.ones(1)], [torch.zeros(1), 1, torch.ones(1) * 2])
    assert "[0]" in str(info.value) and "[2]" in str(info.value)


def test_describe() -> None:
    assert describe(torch.zeros(2, 3)) == "Tensor float32[2, 3] cpu"
    assert describe(None) == "None"
    assert describe(3) == "int 3"


class _Model(torch.nn.Module):
    def forward(
        self, x: torch.Tensor, y: torch.Tensor, *, ids: torch.Tensor, n: int
    ) -> torch.Tensor:
        return x.sum() + y.sum() + ids.sum() + n


def test_random_inputs_fit_the_signature() -> None:
    batch = Dim("batch", min=2, max=6)
    ep = torch.export.export(
        _Model(),
        (torch.randn(4, 3), torch.randn(8)),
        {"ids": torch.tensor([1, 2]), "n": 3},
        dynamic_shapes=({0: batch}, {0: 2 * batch}, None, None),
    )
    graph = to_program(ep).graph
    args, kwargs = random_inputs(graph, seed=1)
    assert args[0].shape == (4, 3) and args[1].shape == (8,)
    assert kwargs["ids"].dtype == torch.int64 and kwargs["n"] == 3
    ep.module()(*args, **kwargs)  # eager accepts them
    for seed in range(5):
        args, kwargs = random_inputs(graph, seed=seed, vary_dims=True)
        assert 2 <= args[0].shape[0] <= 6
        assert args[1].shape[0] == 2 * args[0].shape[0]  # the derived dimension follows
        ep.module()(*args, **kwargs)
    a1, _ = random_inputs(graph, seed=3)
    a2, _ = random_inputs(graph, seed=3)
    assert torch.equal(a1[0], a2[0])  # seeded
