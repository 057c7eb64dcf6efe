"""Errors name inputs and dims in the user's words (issue 37, 2).

An input is named by the forward's parameter (`x`), a keyword input by its keyword (`mask`), a
leaf of a structure by its path from the parameter (`inputs['a'][0]`), an fx GraphModule's by
its placeholder, a GraphBuilder's by the name it was declared with; a dynamic dim by the name
of the user's `Dim` where torch.export kept it (`Dim 'batch'`), else as a dynamic dim. Every
message still says expected versus actual. The names are worked out once, at import.
"""

from __future__ import annotations

import io
import operator
from typing import Any

import pytest
import torch
from torch.export import Dim
from torch.fx.experimental.proxy_tensor import make_fx

import asyncgraph
from asyncgraph import GraphBuilder, InputValidationError
from asyncgraph.graph.importers import to_program
from asyncgraph.graph.ir import TensorSpec
from asyncgraph.runtime.validation import InputValidator
from tests.support.backends import run

pytestmark = pytest.mark.usefixtures("leak_check")


class Linear16(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Parity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.size(0) % 2 == 0 else x * 0


class Masked(torch.nn.Module):
    def forward(self, a: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return a + mask


class Nested(torch.nn.Module):
    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        return inputs["a"][0] + inputs["b"]


class Shifted(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x[1:] + y


def _batch_ep() -> torch.export.ExportedProgram:
    return torch.export.export(Linear16(), (torch.randn(2, 16),),
                               dynamic_shapes=({0: Dim("batch", min=1, max=64)},))


async def _refused(program: Any, *args: Any, **kwargs: Any) -> InputValidationError:
    """The error the Executor raises for the call, before it takes a frame."""
    async with asyncgraph.Executor(program) as ex:
        with pytest.raises(InputValidationError) as info:
            await ex.execute(*args, **kwargs)
        assert ex.statistics().started == 0
    return info.value


async def test_a_range_error_names_the_argument_and_the_users_dim() -> None:
    ep = _batch_ep()
    error = await _refused(ep, torch.ones(100, 16))
    assert str(error) == "x.shape[0]: expected a size in [1, 64] (Dim 'batch'), got 100"
    assert error.path == "x"
    error = await _refused(ep, torch.ones(10, 8))
    assert str(error) == "x.shape[1]: expected 16, got 8"


def test_a_range_error_names_them_on_every_backend(backend: str) -> None:
    ep = _batch_ep()

    async def body() -> None:
        error = await _refused(ep, torch.ones(100, 16))
        assert str(error) == "x.shape[0]: expected a size in [1, 64] (Dim 'batch'), got 100"

    run(body, backend)


async def test_a_dim_without_a_users_name_is_named_as_a_dynamic_dim_of_the_argument() -> None:
    ep = torch.export.export(Linear16(), (torch.randn(2, 16),),
                             dynamic_shapes=({0: Dim.DYNAMIC(max=64)},))
    error = await _refused(ep, torch.ones(100, 16))
    assert error.path == "x"
    assert str(error) == (
        "x.shape[0]: expected a size in [2, 64] (dynamic dim of x.shape[0]), got 100")


async def test_a_broken_guard_names_the_argument() -> None:
    ep = torch.export.export(Parity(), (torch.randn(4),),
                             dynamic_shapes={"x": {0: Dim.DYNAMIC}})
    error = await _refused(ep, torch.ones(5))
    assert str(error) == (
        "x.shape[0] = 5 fails the guard x.size()[0] % 2 == 0 the program was exported with"
    )
    assert error.path == "x"


async def test_keyword_inputs_are_named_by_their_keyword() -> None:
    b = Dim("b")
    ep = torch.export.export(Masked(), (torch.randn(2, 3),), {"mask": torch.randn(2, 3)},
                             dynamic_shapes={"a": {0: b}, "mask": {0: b}})
    error = await _refused(ep, torch.ones(2, 3), mask=torch.ones(3, 3))
    assert str(error) == (
        "mask.shape[0]: expected 2 (Dim 'b': the same dimension as a.shape[0]), got 3"
    )
    assert error.path == "mask"
    error = await _refused(ep, torch.ones(2, 3), mask=torch.ones(2, 4))
    assert str(error) == "mask.shape[1]: expected 3, got 4"
    error = await _refused(ep, torch.ones(2, 3), mask=torch.ones(2, 3, dtype=torch.int64))
    assert str(error) == "mask.dtype: expected torch.float32, got torch.int64"


async def test_a_leaf_of_a_nested_input_is_named_by_its_path_from_the_parameter() -> None:
    example = {"a": [torch.randn(2, 3)], "b": torch.randn(2, 3)}
    ep = torch.export.export(Nested(), (example,))
    error = await _refused(ep, {"a": [torch.ones(2, 4)], "b": torch.ones(2, 3)})
    assert str(error) == "inputs['a'][0].shape[1]: expected 3, got 4"
    assert error.path == "inputs['a'][0]"
    error = await _refused(ep, {"a": [torch.ones(2, 3)], "b": torch.ones(2, 3, 1)})
    assert str(error) == "inputs['b']: expected 2 dimension(s), got 3 (shape (2, 3, 1))"
    error = await _refused(ep, {"a": torch.ones(2, 3), "b": torch.ones(2, 3)})
    assert str(error).startswith("inputs: expected structure ")
    error = await _refused(ep)
    assert str(error) == "expected 1 positional argument(s), got 0; the program takes (inputs)"


async def test_a_derived_dim_is_written_over_the_users_names() -> None:
    dx = Dim("dx", min=3, max=32)
    ep = torch.export.export(Shifted(), (torch.randn(5), torch.randn(4)),
                             dynamic_shapes=({0: dx}, {0: dx - 1}))
    error = await _refused(ep, torch.ones(5), torch.ones(5))
    assert str(error) == "x.shape[0]: expected 6 (Dim 'dx' = y.shape[0] + 1), got 5"
    error = await _refused(ep, torch.ones(40), torch.ones(39))
    assert str(error) == "y.shape[0]: expected a size in [2, 31] (Dim 'dx - 1'), got 39"


async def test_a_loaded_pt2_keeps_the_argument_names() -> None:
    """torch.export.save keeps the forward's argument names but not the Dim names: a loaded
    program's dim is named as a dynamic dim of the argument."""
    buffer = io.BytesIO()
    torch.export.save(_batch_ep(), buffer)
    buffer.seek(0)
    ep = torch.export.load(buffer)
    error = await _refused(ep, torch.ones(100, 16))
    assert error.path == "x"
    assert str(error).startswith("x.shape[0]: expected a size in [1, 64] (")
    assert str(error).endswith("), got 100")


def _add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


async def test_an_fx_graph_module_names_its_inputs_by_placeholder() -> None:
    gm = make_fx(_add)(torch.randn(2, 3), torch.randn(2, 3))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    error = await _refused(gm, torch.ones(2, 3), torch.ones(2, 4))
    assert str(error) == f"{names[1]}.shape[1]: expected 3, got 4"
    assert error.path == names[1]


async def test_an_fx_graph_module_over_a_structure_names_its_leaves_by_path() -> None:
    """make_fx of a function taking a dict: its input spec holds the positional arguments
    only; the program runs, and a leaf is named from the function's parameter."""
    gm = make_fx(lambda d: d["a"][0] + d["b"])({"a": [torch.randn(2)], "b": torch.randn(2)})
    async with asyncgraph.Executor(gm) as ex:
        out = await ex.execute({"a": [torch.ones(2)], "b": torch.ones(2)})
        torch.testing.assert_close(list(out), [torch.full((2,), 2.0)])  # fx's output list
    error = await _refused(gm, {"a": [torch.ones(3)], "b": torch.ones(2)})
    assert str(error) == "d['a'][0].shape[0]: expected 2, got 3"


async def test_a_graph_builder_input_is_named_as_declared() -> None:
    b = GraphBuilder()
    image = b.input("image")
    b.output(b.call(operator.mul, image, 2, name="double", placement="inline"))
    graph = b.build()
    graph.values[image.id].spec = TensorSpec(torch.float32, torch.device("cpu"), (2,), (2,))
    assert graph.signature.user_inputs[0].target == "image"
    error = await _refused(graph, torch.ones(3))
    assert str(error) == "image.shape[0]: expected 2, got 3"


def test_the_names_are_worked_out_once_when_the_validator_is_made() -> None:
    ep = torch.export.export(Masked(), (torch.randn(2, 3),), {"mask": torch.randn(2, 3)})
    validator = InputValidator(to_program(ep).graph)
    assert validator.paths == ["a", "mask"]
    assert validator.arg_names == ("a",)
    batch = InputValidator(to_program(_batch_ep()).graph)
    assert list(batch.symbol_names.values()) == ["batch"]
