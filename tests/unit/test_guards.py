"""Export guards beyond ranges (issue 39, 2): checked once per input signature, named errors.

The conformance corpus (tests/conformance/models.py, `guard_*`) runs such programs end to end
against ep.module(); these tests look at the validator itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.export import Dim

from asyncgraph import InputValidationError
from asyncgraph.graph.importers import to_program
from asyncgraph.runtime.validation import InputValidator


class Rows(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 4).sum(1)


def _validator() -> InputValidator:
    ep = torch.export.export(Rows(), (torch.randn(8),),
                             dynamic_shapes={"x": {0: 4 * Dim("rows")}})
    return InputValidator(to_program(ep).graph)


def test_a_broken_guard_names_the_input_the_users_dim_and_the_guard() -> None:
    validator = _validator()
    assert validator.guards, "export recorded no guard for a dim declared 4*rows"
    with pytest.raises(InputValidationError, match=r"^x\.shape\[0\] = 6 "
                       r"\(Dim '4\*rows'\) fails the guard x\.size\(\)\[0\] % 4 == 0"):
        validator.check([torch.randn(6)])


def test_guards_run_once_per_input_signature() -> None:
    validator = _validator()
    runs: list[int] = []

    def counted(holds: Any) -> Any:
        def run(flat: Any) -> bool:
            runs.append(1)
            return bool(holds(flat))
        return run

    validator.guards = [(guard, counted(holds)) for guard, holds in validator.guards]
    for _ in range(3):
        validator.check([torch.randn(8)])
    once = len(runs)
    assert once == len(validator.guards)
    validator.check([torch.randn(12)])  # a new signature: checked again
    validator.check([torch.randn(8)])
    assert len(runs) == 2 * once
