"""The model corpus (models.py) runs on asyncgraph and matches ep.module(), leaf for leaf.

Every case runs as exported, and after run_decompositions(); the real architectures and the
decomposed programs run on asyncio only (they are the slow part, and the event loop does not
change what is computed), the small programs on both loops. Each run
goes through the serial and the parallel executor, execute and execute_flat (harness.py).
Points of the issue that need more than the generic comparison have their own tests below.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from asyncgraph import InputValidationError
from asyncgraph.tools.compare import assert_same
from conformance import models
from conformance.harness import (
    CONFIGS,
    assert_conforms,
    cached_export,
    close_all,
    hop_names,
    make_executor,
)
from conformance.models import CASES, CASES_BY_NAME, EFFECT_LOG

pytestmark = pytest.mark.usefixtures("leak_check")


def exported(name: str, decomposed: bool = False) -> torch.export.ExportedProgram:
    case = CASES_BY_NAME[name]

    def build() -> torch.export.ExportedProgram:
        if decomposed:
            return exported(name).run_decompositions()
        with warnings.catch_warnings():
            # nn.LSTM/GRU assign _flat_weights during export; torch warns about it itself.
            warnings.filterwarnings("ignore", message=".*were assigned during export.*")
            return models.export_case(case, decomposed=False)

    return cached_export(("model", name, decomposed), build)


@pytest.mark.parametrize("name", [c.name for c in CASES if not c.architecture])
async def test_model_as_exported(name: str) -> None:
    await _as_exported(name)


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("name", [c.name for c in CASES if c.architecture])
async def test_architecture_as_exported(name: str) -> None:
    await _as_exported(name)


async def _as_exported(name: str) -> None:
    case = CASES_BY_NAME[name]
    if case.skip is not None:
        pytest.skip(case.skip)
    if case.export_limit is not None and case.export_limit.applies():
        case.export_limit.assert_export_fails(name, lambda: exported(name))
        return
    ep = exported(name)
    assert case.hops <= hop_names(ep), f"{name}: the export no longer contains {case.hops}"
    outcome = await assert_conforms(ep, case.calls())
    assert outcome.both_raised == 0


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("name", [c.name for c in CASES if c.decompose])
async def test_model_decomposed(name: str) -> None:
    case = CASES_BY_NAME[name]
    if case.skip is not None:
        pytest.skip(case.skip)
    if case.export_limit is not None and case.export_limit.applies():
        case.export_limit.assert_export_fails(name, lambda: exported(name, decomposed=True))
        return
    outcome = await assert_conforms(exported(name, decomposed=True), case.calls())
    assert outcome.both_raised == 0


# -- points that need their own checks ---------------------------------------------------------


@pytest.mark.parametrize("decomposed", [False, True])
async def test_effects_happen_in_eager_order(decomposed: bool) -> None:
    """The effectful op's side effects (a log) come out in the order eager produces them."""
    ep = exported("effects", decomposed)
    calls = CASES_BY_NAME["effects"].calls()
    EFFECT_LOG.clear()
    for args, kwargs in calls:
        ep.module()(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    expected = list(EFFECT_LOG)
    assert len(expected) == 3 * len(calls)
    for config in CONFIGS.values():
        ex = make_executor(ep, config)
        try:
            EFFECT_LOG.clear()
            for args, kwargs in calls:
                await ex.execute(*copy.deepcopy(args), **copy.deepcopy(kwargs))
            assert expected == EFFECT_LOG
        finally:
            await close_all(ex)
    assert "with_effects" in {k.name.removeprefix("higher_order.") for k in ex.kernels}


async def test_dynamic_dimension_out_of_range_is_rejected() -> None:
    """A size outside the exported range is an InputValidationError naming the input.

    ep.module() in this torch does not check ranges (it returns a result for n=1 although the
    program asserted n >= 2); asyncgraph refuses before taking a frame.
    """
    ep = exported("symbolic_arithmetic")
    ex = make_executor(ep, CONFIGS["serial"])
    try:
        with pytest.raises(InputValidationError, match=r"^x\.shape\[0\].*\[2, 16\].*got 1"):
            await ex.execute(torch.randn(1, 3), torch.randn(2))
        with pytest.raises(InputValidationError, match=r"^y\.shape\[0\].*got 17"):
            await ex.execute(torch.randn(4, 3), torch.randn(17))
        assert ex.statistics().started == 0
    finally:
        await close_all(ex)


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("decomposed", [False, True], ids=["exported", "decomposed"])
@pytest.mark.parametrize("name", [c.name for c in CASES if c.invalid is not None])
async def test_inputs_breaking_a_guard_are_refused(name: str, decomposed: bool) -> None:
    """Inputs that break a guard export recorded (divisibility, derived dims, torch._check on
    a size): ep.module() refuses them, and so does asyncgraph, before taking a frame, with an
    InputValidationError naming the input, the dim and the guard (issue 39, 2). Valid calls
    in between keep passing (the validator caches only signatures that passed)."""
    case = CASES_BY_NAME[name]
    assert case.invalid is not None
    ep = exported(name, decomposed)
    ex = make_executor(ep, CONFIGS["serial"])
    try:
        for (args, kwargs), message in case.invalid():
            with pytest.raises(Exception):  # noqa: B017 - torch's wording varies by version
                ep.module()(*copy.deepcopy(args), **copy.deepcopy(kwargs))
            for _ in range(2):
                with pytest.raises(InputValidationError, match=message):
                    await ex.execute(*args, **kwargs)
            assert ex.statistics().started == 0
        for args, kwargs in case.calls():
            assert_same(await ex.execute(*args, **kwargs), ep.module()(*args, **kwargs))
    finally:
        await close_all(ex)


async def test_unbacked_size_checks_fail_like_eager() -> None:
    """An .item() value that breaks the program's torch._check fails in both, not silently."""
    ep = exported("unbacked_item")
    x, k = torch.randn(6, 3), torch.tensor(9)  # 9 > x.shape[0]
    with pytest.raises(RuntimeError):
        ep.module()(x, k)
    ex = make_executor(ep, CONFIGS["parallel"])
    try:
        with pytest.raises(RuntimeError) as info:
            await ex.execute(x, k)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "While executing %" in notes  # the failing node is named
    finally:
        await close_all(ex)


async def test_aliased_outputs_keep_eager_aliasing_of_inputs() -> None:
    """An output that *is* an input in eager is the same tensor object in asyncgraph too."""
    ep = exported("aliased_outputs")
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    expected = ep.module()(x, y)
    assert expected[0] is x
    ex = make_executor(ep, CONFIGS["serial"])
    try:
        got = await ex.execute(x, y)
    finally:
        await close_all(ex)
    assert_same(got, expected)
    assert got[0] is x


async def test_control_flow_on_the_asyncgraph_scheduler() -> None:
    """cond/while_loop/map/scan nodes are async kernels whose subgraphs ran on inner executors."""
    for name in ("nested_cond", "while_counter", "map_with_cond", "scan_cumulative"):
        ep = exported(name)
        ex = make_executor(ep, CONFIGS["parallel"])
        try:
            for args, kwargs in CASES_BY_NAME[name].calls():
                await ex.execute(*args, **kwargs)
            control = [k for k in ex.kernels if hasattr(k.fn, "executors")]
            assert control, f"{name}: no control-flow kernel"
            for kernel in control:
                assert kernel.kind.value == "async"
                completed = sum(e.statistics().completed for e in kernel.fn.executors())
                assert completed > 0, f"{name}: {kernel.name} never ran a subgraph"
        finally:
            await close_all(ex)
