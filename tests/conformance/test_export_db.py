"""Every example of torch's export database runs on asyncgraph and matches ep.module().

Each example is exported as torch.export does by default (non-strict), run as exported and
after run_decompositions(), and exported again in strict mode (torch.compile's frontend), each
through the serial and the parallel executor (see harness.py). Dynamic examples get a second
call with other sizes. Examples that cannot be supported are listed below with the reason, and
the test checks that the reason still holds: a listed example that starts working, or that
fails differently, fails its test until the list is updated.

The corpus is heavy (two exports and a decomposition per example), so it runs on one event loop;
the loop-specific behaviour is covered by the model corpus, which runs on both.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from typing import Any

import pytest
import torch
from torch._export.db.case import ExportCase
from torch._export.db.examples import all_examples

from conformance.harness import TorchExportLimit, assert_conforms, cached_export

pytestmark = [
    pytest.mark.usefixtures("leak_check"),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

EXAMPLES: dict[str, ExportCase] = dict(sorted(all_examples().items()))

# Examples torch.export itself rejects: (reason, pattern the export error must match).
CANNOT_EXPORT: dict[str, tuple[str, str]] = {
    "dynamic_shape_round": (
        "torch.export rejects it (the db marks it NOT_SUPPORTED_YET): round() of a dynamic "
        "size produces a guard that does not hold over the whole range of the dimension",
        r"Constraints violated",
    ),
}

# Examples an older torch cannot export in one mode (torch's limits, seen on torch 2.11).
OLDER_TORCH_CANNOT_EXPORT: dict[tuple[str, str], TorchExportLimit] = {
    ("unsupported_operator", "strict"): TorchExportLimit(
        (2, 13), "dynamo before torch 2.13 cannot trace torch.sym_min, which returns an int",
        r"torch\.\* op returned non-Tensor"),
}

# Examples that export but that asyncgraph cannot run: (reason, pattern of the error). Empty:
# every exportable example runs. An entry here must come with its reason in docs/support.md.
ASYNCGRAPH_UNSUPPORTED: dict[str, tuple[str, str]] = {}

MODES = [("nonstrict", False), ("nonstrict-decomposed", True), ("strict", False)]


def _export(name: str, strict: bool, decomposed: bool) -> torch.export.ExportedProgram:
    case = EXAMPLES[name]

    def build() -> torch.export.ExportedProgram:
        if decomposed:
            return cached_export(("db", name, strict, False), lambda: _export(name, strict, False)
                                 ).run_decompositions()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own export-time advice (e.g. setattr)
            return torch.export.export(
                case.model,
                copy.deepcopy(case.example_args),
                copy.deepcopy(case.example_kwargs),
                dynamic_shapes=case.dynamic_shapes,
                strict=strict,
            )

    return cached_export(("db", name, strict, decomposed), build)


def _calls(case: ExportCase) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The example inputs, then the extra ones, then the example resized in its dynamic dims."""
    calls = [(tuple(case.example_args), dict(case.example_kwargs))]
    if case.extra_args is not None:
        calls.append((tuple(case.extra_args), {}))
    if case.dynamic_shapes:
        names = list(inspect.signature(case.model.forward).parameters)
        args = list(case.example_args)
        for arg_name, dims in case.dynamic_shapes.items():
            if not dims:
                continue
            i = names.index(arg_name)
            shape = list(args[i].shape)
            for axis in dims:
                shape[axis] += 2
            args[i] = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        calls.append((tuple(args), dict(case.example_kwargs)))
    return calls


@pytest.mark.parametrize("mode", [m for m, _ in MODES])
@pytest.mark.parametrize("name", list(EXAMPLES))
async def test_export_db_example(name: str, mode: str) -> None:
    strict = mode == "strict"
    decomposed = mode.endswith("decomposed")
    if name in CANNOT_EXPORT:
        reason, pattern = CANNOT_EXPORT[name]
        with pytest.raises(Exception) as info:
            _export(name, strict, decomposed)
        assert re.search(pattern, str(info.value)), (
            f"{name}: listed as not exportable ({reason}), but export failed differently: "
            f"{info.value!r}"
        )
        return
    limit = OLDER_TORCH_CANNOT_EXPORT.get((name, mode))
    if limit is not None and limit.applies():
        limit.assert_export_fails(name, lambda: _export(name, strict, decomposed))
        return
    ep = _export(name, strict, decomposed)
    case = EXAMPLES[name]
    if name in ASYNCGRAPH_UNSUPPORTED:
        reason, pattern = ASYNCGRAPH_UNSUPPORTED[name]
        with pytest.raises(Exception) as info:
            await assert_conforms(ep, _calls(case))
        assert re.search(pattern, str(info.value)), (
            f"{name}: listed as unsupported ({reason}), but failed differently: {info.value!r}"
        )
        return
    outcome = await assert_conforms(ep, _calls(case))
    assert outcome.both_raised == 0, f"{name}: eager rejected its own example inputs"


async def test_the_corpus_is_the_whole_database() -> None:
    """Nothing is skipped: the database has the examples the tests were written against."""
    assert len(EXAMPLES) >= 30
    assert set(CANNOT_EXPORT) <= set(EXAMPLES)
    assert set(ASYNCGRAPH_UNSUPPORTED) <= set(EXAMPLES)
