"""Mode.DIRECT (asyncgraph/runtime/direct.py): a program that is one delegate call and the
getitems taking its outputs apart runs, once its placement is settled on the loop, as that
call: outputs, weights versions, errors and counts as on the general path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.fx

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.compiled.build import segment_module
from asyncgraph.compiled.segments import Segment, replace_segments, tensor_bounded_segments
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.kernels.base import KernelKind
from asyncgraph.runtime.delegates import SegmentBackend, register_backend, unregister_backend
from asyncgraph.runtime.weights import weights_ran_on
from tests.support.models import DeepMLP, eager_output, export_model

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]

BACKEND = "direct_fx"
CALLS = 60  # enough for adaptive placement to profile the signature and settle it


class FxDelegate:
    """A delegate running its nodes as the fx module, noting the mode of each call."""

    kernel_kind = KernelKind.DELEGATE

    def __init__(self, name: str, module: torch.fx.GraphModule, guard: bool) -> None:
        self.__name__ = name
        self.module = module
        self.needs_inference_mode = guard
        self.inference: list[bool] = []  # per call: whether inference mode was on
        self.fail = False

    def __call__(self, *inputs: Any) -> list[Any]:
        self.inference.append(torch.is_inference_mode_enabled())
        if self.fail:
            raise ValueError("the delegate was told to fail")
        with torch.no_grad():  # as compiled code records no autograd, in any mode
            return list(self.module(*inputs))

    def prepare_weights(self, tensors: Any) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def statistics(self) -> dict[str, Any]:
        return {"calls": len(self.inference)}


@pytest.fixture(params=[True, False], ids=["guarded", "unguarded"])
def guard(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The backend, its delegates saying `needs_inference_mode` = the param."""

    def plan(graph: Graph, config: ExecutorConfig) -> tuple[Graph, list[str]]:
        segments = tensor_bounded_segments(
            graph, "auto", lambda vid: isinstance(graph.values[vid].spec, TensorSpec),
            min_nodes=2)

        def delegate(segment: Segment) -> tuple[str, FxDelegate]:
            name = f"{BACKEND}_segment_{segment.index}"
            return name, FxDelegate(name, segment_module(graph, segment), request.param)

        return replace_segments(graph, segments, delegate), [
            f"{BACKEND}_segment_{s.index}" for s in segments]

    register_backend(SegmentBackend(BACKEND, lambda: plan))
    yield request.param
    unregister_backend(BACKEND)


def _delegate(ex: Executor) -> FxDelegate:
    (delegate,) = [k.fn for k in ex.kernels if isinstance(k.fn, FxDelegate)]
    return delegate


async def test_a_one_call_program_runs_as_its_call(guard: bool) -> None:
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,))) as ex:
        delegate = _delegate(ex)
        for _ in range(CALLS):
            out = await ex.execute(x)
            torch.testing.assert_close(out, eager_output(model, x))
            assert weights_ran_on() == 0
        stats = ex.statistics()
        assert stats.modes["DIRECT"] >= CALLS // 2, stats.modes  # settled, then direct
        assert stats.started == stats.completed == CALLS and stats.failed == 0
        # the general path always guards; Mode.DIRECT only where the delegate needs it
        assert delegate.inference.count(False) == (0 if guard else stats.modes["DIRECT"])
        assert not out.requires_grad

        with torch.no_grad():  # a swap: the call's weights laid out again
            for p in model.parameters():
                p.mul_(-0.5)
        version = ex.swap_weights(dict(model.state_dict()))
        before = ex.statistics().modes["DIRECT"]
        for _ in range(8):
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
            assert weights_ran_on() == version
        # direct on the new weights (a call may take the general path: a spent slice)
        assert ex.statistics().modes["DIRECT"] > before


@pytest.mark.parametrize("guard", [False], indirect=True, ids=["unguarded"])
async def test_a_direct_calls_error_names_its_node_and_the_next_call_runs(guard: bool) -> None:
    """Unguarded, a call without inference mode is a direct one: failures until one is."""
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,))) as ex:
        for _ in range(CALLS):
            await ex.execute(x)
        assert ex.statistics().modes["DIRECT"] > 0
        delegate = _delegate(ex)
        delegate.fail = True
        failures = 0
        while failures < 20:
            failures += 1
            with pytest.raises(ValueError, match="told to fail") as caught:
                await ex.execute(x)
            assert any(f"%{BACKEND}_segment_0" in note for note in caught.value.__notes__)
            if delegate.inference[-1] is False:
                break  # Mode.DIRECT's
        assert delegate.inference[-1] is False, "no failure in Mode.DIRECT"
        delegate.fail = False
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = ex.statistics()
        assert stats.failed == failures and stats.completed == CALLS + 1
        assert stats.started == stats.completed + stats.failed


async def test_traced_or_plain_programs_never_run_direct(guard: bool) -> None:
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    ep = export_model(model, x)
    for config in (ExecutorConfig(segments=(BACKEND,), trace=True), ExecutorConfig()):
        async with Executor(ep, config) as ex:
            for _ in range(CALLS // 2):
                torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
            assert ex.statistics().modes["DIRECT"] == 0
