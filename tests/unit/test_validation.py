"""Input validation: exact messages naming the input path, expected versus actual."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import asyncgraph
from asyncgraph import InputValidationError
from asyncgraph.runtime.validation import InputValidator

pytestmark = pytest.mark.usefixtures("leak_check")


class Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
        return (x + y) * scale


class Nested(torch.nn.Module):
    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["a"] - d["b"]


@pytest.fixture(scope="module")
def pair_ep() -> torch.export.ExportedProgram:
    b = Dim("b", min=2, max=16)
    return torch.export.export(
        Pair(), (torch.randn(4, 8), torch.randn(4, 8)), {"scale": 2.0},
        dynamic_shapes={"x": {0: b}, "y": {0: b}, "scale": None},
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((torch.randn(4, 8),), {"scale": 2.0},
         "expected 2 positional argument(s), got 1; the program takes (x, y, *, scale)"),
        ((torch.randn(4, 8), torch.randn(4, 8)), {"scale": 2.0, "bias": 1},
         "unexpected keyword argument(s) 'bias'; the program takes (x, y, *, scale)"),
        ((torch.randn(4, 8), torch.randn(4, 8)), {},
         "missing keyword argument(s) 'scale'; the program takes (x, y, *, scale)"),
        ((torch.randn(4, 8),), {"y": torch.randn(4, 8), "scale": 2.0},
         "unexpected keyword argument(s) 'y'; the program takes (x, y, *, scale): "
         "pass y by position"),
        ((torch.randn(4, 8), 3), {"scale": 2.0}, "y: expected a Tensor, got int"),
        ((torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8)), {"scale": 2.0},
         "x.dtype: expected torch.float32, got torch.float64"),
        ((torch.randn(4, 8), torch.randn(4, 8, 1)), {"scale": 2.0},
         "y: expected 2 dimension(s), got 3 (shape (4, 8, 1))"),
        ((torch.randn(4, 32), torch.randn(4, 8)), {"scale": 2.0},
         "x.shape[1]: expected 8, got 32"),
        ((torch.randn(4, 8), torch.randn(5, 8)), {"scale": 2.0},
         "y.shape[0]: expected 4 (Dim 'b': the same dimension as x.shape[0]), got 5"),
        ((torch.randn(32, 8), torch.randn(32, 8)), {"scale": 2.0},
         "x.shape[0]: expected a size in [2, 16] (Dim 'b'), got 32"),
        ((torch.randn(4, 8), torch.randn(4, 8)), {"scale": 3.0},
         "scale: expected 2.0 (fixed when the program was exported), got 3.0"),
    ],
)
async def test_bad_inputs_get_exact_errors(
    pair_ep: torch.export.ExportedProgram, args: tuple, kwargs: dict, message: str
) -> None:
    async with asyncgraph.Executor(pair_ep) as ex:
        with pytest.raises(InputValidationError) as info:
            await ex.execute(*args, **kwargs)
        assert str(info.value).replace(_symbol(pair_ep), "s77") == message
        assert ex.statistics().started == 0  # rejected before a frame was taken


def _symbol(ep: torch.export.ExportedProgram) -> str:
    return str(next(iter(ep.range_constraints)))


async def test_nested_structure_mismatch_names_the_argument() -> None:
    ep = torch.export.export(Nested(), ({"a": torch.randn(3), "b": torch.randn(3)},))
    async with asyncgraph.Executor(ep) as ex:
        with pytest.raises(InputValidationError) as info:
            await ex.execute({"a": torch.randn(3)})
        assert str(info.value) == (
            "d: expected structure "
            f"{torch.utils._pytree.tree_structure({'a': 0, 'b': 0})}, "
            f"got {torch.utils._pytree.tree_structure({'a': 0})}"
        )


async def test_execute_flat_checks_count() -> None:
    ep = torch.export.export(Nested(), ({"a": torch.randn(3), "b": torch.randn(3)},))
    async with asyncgraph.Executor(ep) as ex:
        with pytest.raises(InputValidationError, match=r"^expected 2 input\(s\), got 1$"):
            await ex.execute_flat([torch.randn(3)])
        out = await ex.execute_flat([torch.ones(3), torch.ones(3)])
        torch.testing.assert_close(out, [torch.zeros(3)])


async def test_validation_can_be_disabled_but_count_is_kept() -> None:
    ep = torch.export.export(Nested(), ({"a": torch.randn(3), "b": torch.randn(3)},))
    config = asyncgraph.ExecutorConfig(validate_inputs=False)
    async with asyncgraph.Executor(ep, config) as ex:
        # shapes are not checked: broadcasting happens inside the kernel
        out = await ex.execute_flat([torch.ones(3), torch.ones(1)])
        torch.testing.assert_close(out, [torch.zeros(3)])
        with pytest.raises(InputValidationError, match="expected 2 input"):
            await ex.execute_flat([torch.ones(3)])


def test_device_index_is_checked() -> None:
    from asyncgraph.graph.ir import TensorSpec
    from asyncgraph.runtime.validation import InputValidator

    b = asyncgraph.GraphBuilder()
    b.output(b.call(lambda t: t, b.input("x"), name="ident"))
    graph = b.build()
    validator = InputValidator(graph)
    validator.specs = [TensorSpec(torch.float32, torch.device("meta", 0), (2,), (2,))]
    with pytest.raises(InputValidationError, match=r"^x\.device: expected meta:0, got"):
        validator.check([torch.empty(2, device="meta")])


async def test_inputs_like_ones_that_passed_skip_the_check_and_others_are_still_checked(
    pair_ep: torch.export.ExportedProgram,
) -> None:
    """Validation remembers the signatures (shapes, dtypes, devices, scalar values) that
    passed; anything that differs in one of them is checked in full, errors included."""
    async with asyncgraph.Executor(pair_ep) as ex:
        x = torch.randn(4, 8)
        await ex.execute(x, x, scale=2.0)
        await ex.execute(torch.randn(4, 8), torch.randn(4, 8), scale=2.0)
        assert ex.statistics().validated_signatures == 1  # the same signature, other values
        bad = [
            ((x, torch.randn(5, 8)), "the same dimension"),
            ((x.double(), x), "dtype"),
            ((torch.randn(32, 8), torch.randn(32, 8)), "expected a size in"),
        ]
        for args, message in bad:
            with pytest.raises(InputValidationError, match=message):
                await ex.execute(*args, scale=2.0)
        with pytest.raises(InputValidationError, match="fixed when the program was exported"):
            await ex.execute(x, x, scale=3.0)
        assert ex.statistics().validated_signatures == 1  # failures are not remembered


class Single(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


async def test_a_keyword_for_a_positional_only_program_is_named() -> None:
    ep = torch.export.export(Single(), (torch.randn(2, 3),))
    async with asyncgraph.Executor(ep) as ex:
        with pytest.raises(InputValidationError) as info:
            await ex.execute(x=torch.randn(2, 3))
        assert str(info.value) == (
            "unexpected keyword argument(s) 'x'; the program takes (x): pass x by position"
        )
        with pytest.raises(InputValidationError) as info:
            await ex.execute(torch.randn(2, 3), torch.randn(2, 3))
        assert str(info.value) == (
            "expected 1 positional argument(s), got 2; the program takes (x)"
        )


async def test_nested_positional_arguments_are_named_by_path() -> None:
    ep = torch.export.export(Nested(), ({"a": torch.randn(2), "b": torch.randn(2)},))
    async with asyncgraph.Executor(ep) as ex:
        with pytest.raises(InputValidationError) as info:
            await ex.execute()
        assert str(info.value) == (
            "expected 1 positional argument(s), got 0; the program takes (d)"
        )


def test_check_returns_the_signature_that_inputs_alike_share() -> None:
    """The signature validation keys its passed checks by, handed on to adaptive placement:
    equal for inputs alike, different when a shape, dtype or scalar differs, None for an
    input that is neither a tensor nor a plain scalar (checked in full each time)."""
    ep = torch.export.export(
        Single(), (torch.randn(2, 3),), dynamic_shapes=({0: Dim("n")},)
    )
    ex = asyncgraph.Executor(ep)  # the graph as the Executor runs it
    validator = InputValidator(ex.graph, ex.config.max_unbounded_int)
    signature = validator.check([torch.randn(2, 3)])
    assert signature is not None
    assert validator.check([torch.randn(2, 3)]) is signature  # a repeat: the same object
    other = validator.check([torch.randn(4, 3)])
    assert other is not None and other != signature
    again = validator.check([torch.randn(2, 3)])
    assert again == signature  # from the passed checks
    assert validator.check([torch.randn(2, 3)]) is again
    wrong = r"x\.dtype: expected torch.float32, got torch.int64"
    with pytest.raises(InputValidationError, match=wrong):
        validator.check([torch.zeros(2, 3, dtype=torch.int64)])
