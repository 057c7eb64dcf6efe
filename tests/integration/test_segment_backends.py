"""Segment backends (asyncgraph/runtime/delegates.py): a delegate is a module and a registration.

A backend registered here, from a test module, is planned and run by an Executor whose config
names it, with nothing added to runtime/: the proof that a new delegate (OpenVINO, say) needs
no branch in the builder, the config or the Executor. The library's own delegates satisfy the
same `Delegate` protocol, which the Executor checks instead of looking for methods by name.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.compiled.build import segment_module
from asyncgraph.compiled.segments import Segment, replace_segments, tensor_bounded_segments
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.kernels.base import KernelKind
from asyncgraph.runtime.delegates import (
    Delegate,
    SegmentBackend,
    register_backend,
    registered_backends,
    unregister_backend,
)
from tests.support.models import Chain, eager_output, export_model

pytestmark = pytest.mark.usefixtures("leak_check")

BACKEND = "plain_fx"


class PlainFxDelegate:
    """The least a delegate is: it runs its run of nodes as the plain fx module."""

    kernel_kind = KernelKind.DELEGATE  # what KernelFactory places as a delegate node

    def __init__(self, name: str, module: torch.fx.GraphModule) -> None:
        self.__name__ = name
        self.module = module
        self.calls = 0
        self.prepared: list[set[str]] = []
        self.closed = False

    def __call__(self, *inputs: Any) -> list[Any]:
        self.calls += 1
        return list(self.module(*inputs))

    def prepare_weights(self, tensors: Any) -> None:
        self.prepared.append(set(tensors))

    async def aclose(self) -> None:
        self.closed = True

    def statistics(self) -> dict[str, Any]:
        return {"calls": self.calls}


def plan_plain_fx(graph: Graph, config: ExecutorConfig) -> tuple[Graph, list[str]]:
    """The backend's planning pass: each long run of aten nodes as one PlainFxDelegate."""
    segments = tensor_bounded_segments(
        graph, "auto", lambda vid: isinstance(graph.values[vid].spec, TensorSpec))

    def delegate(segment: Segment) -> tuple[str, PlainFxDelegate]:
        name = f"{BACKEND}_segment_{segment.index}"
        return name, PlainFxDelegate(name, segment_module(graph, segment))

    names = [f"{BACKEND}_segment_{s.index}" for s in segments]
    return (replace_segments(graph, segments, delegate) if segments else graph), names


@pytest.fixture
def plain_fx_backend() -> Any:
    register_backend(SegmentBackend(BACKEND, lambda: plan_plain_fx))
    yield
    unregister_backend(BACKEND)


def _delegates(ex: Executor) -> list[PlainFxDelegate]:
    return [k.fn for k in ex.kernels if isinstance(k.fn, PlainFxDelegate)]


async def test_a_backend_registered_outside_the_runtime_is_planned_and_run(
    plain_fx_backend: None,
) -> None:
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    ex = Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,)))
    try:
        assert ex.segments == {BACKEND: [f"{BACKEND}_segment_0"]}
        assert ex.scripted == [] and ex.onnx == []
        (delegate,) = _delegates(ex)
        assert isinstance(delegate, Delegate)
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        assert delegate.calls == 1
        bias = torch.zeros(16)
        await ex.aswap_weights({"linear.bias": bias})  # the delegate prepares the new version
        assert delegate.prepared and "linear.bias" in delegate.prepared[-1]
        with torch.no_grad():
            model.linear.bias.copy_(bias)
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        assert delegate.calls == 2
    finally:
        await ex.aclose()
    assert delegate.closed


async def test_a_backend_whose_nodes_are_no_delegates_is_refused_by_name(
    plain_fx_backend: None,
) -> None:
    """The builder checks the planned nodes against the protocol, naming backend and node."""

    class Unclosable:  # no aclose: its threads, if any, would outlive the Executor
        kernel_kind = KernelKind.DELEGATE

        def __init__(self, module: torch.fx.GraphModule) -> None:
            self.module = module

        def __call__(self, *inputs: Any) -> list[Any]:
            return list(self.module(*inputs))

        def prepare_weights(self, tensors: Any) -> None:
            pass

        def statistics(self) -> dict[str, Any]:
            return {}

    def plan_unclosable(graph: Graph, config: ExecutorConfig) -> tuple[Graph, list[str]]:
        segments = tensor_bounded_segments(
            graph, "auto", lambda vid: isinstance(graph.values[vid].spec, TensorSpec))
        return replace_segments(graph, segments, lambda s: (
            f"{BACKEND}_segment_{s.index}", Unclosable(segment_module(graph, s)),
        )), [f"{BACKEND}_segment_{s.index}" for s in segments]

    register_backend(SegmentBackend(BACKEND, lambda: plan_unclosable))
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    with pytest.raises(TypeError, match=rf"segment backend '{BACKEND}' made "
                                        rf"{BACKEND}_segment_0, .* not a Delegate"):
        Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,)))


async def test_an_unknown_backend_is_named_with_the_registered_ones() -> None:
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    with pytest.raises(ValueError, match=r"no segment backend named 'openvino'; registered: "
                                         r"'aoti', 'onnx', 'script'"):
        Executor(export_model(model, x), ExecutorConfig(segments=("openvino",)))
    assert {"aoti", "onnx", "script"} <= set(registered_backends())


async def test_the_aoti_backend_asked_for_segments_says_what_to_do_instead() -> None:
    """"aoti" builds the default path's AOTInductor form from the whole program; asked for as
    segments it says how to get compiled segments."""
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    with pytest.raises(ValueError, match=r"segments=\('aoti',\)\): .* asyncgraph compile"):
        Executor(export_model(model, x), ExecutorConfig(segments=("aoti",)))


def test_the_librarys_delegates_satisfy_the_protocol() -> None:
    from asyncgraph.compiled.delegate import AOTIDelegate
    from asyncgraph.compiled.scripted import ScriptedDelegate

    assert issubclass(ScriptedDelegate, Delegate)  # torch.jit traces
    assert issubclass(AOTIDelegate, Delegate)  # loaded from a compiled package, not planned
    onnx_delegate = pytest.importorskip("asyncgraph.compiled.onnx_delegate")
    assert issubclass(onnx_delegate.OnnxDelegate, Delegate)


async def test_the_deprecated_flags_map_to_segments() -> None:
    with pytest.warns(DeprecationWarning, match=r"script_segments=True\) is deprecated: "
                                                r"use segments=\('script',\)"):
        config = ExecutorConfig(script_segments=True)
    assert config.segments == ("script",)
    with pytest.warns(DeprecationWarning) as warned:
        both = ExecutorConfig(onnx_segments=True, script_segments=True)
    assert both.segments == ("script", "onnx")  # the order the two branches ran in
    assert [str(w.message).split(" is ")[0] for w in warned] == [
        "ExecutorConfig(script_segments=True)", "ExecutorConfig(onnx_segments=True)"]
    with pytest.warns(DeprecationWarning):  # a backend named both ways is planned once
        once = ExecutorConfig(segments=("onnx",), onnx_segments=True)
    assert once.segments == ("onnx",)


async def test_scripted_and_onnx_are_read_only_views_of_segments() -> None:
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), ExecutorConfig(segments=("script",))) as ex:
        assert ex.segments == {"script": ["scripted_segment_0"]}
        assert ex.scripted == ["scripted_segment_0"] and ex.onnx == []
        with pytest.raises(AttributeError):
            ex.scripted = []  # type: ignore[misc]


def test_the_cli_spells_segments_as_a_list_of_backends() -> None:
    import typer

    from asyncgraph.cli.options import chosen_segments

    assert chosen_segments(None, False) == ()
    assert chosen_segments("onnx, script", False) == ("onnx", "script")
    assert chosen_segments(None, True) == ("script",)  # --script-segments
    assert chosen_segments("onnx", True) == ("script", "onnx")
    with pytest.raises(typer.BadParameter, match=r"no segment backend named 'openvino'"):
        chosen_segments("onnx,openvino", False)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_builder_thread_whose_work_raises_still_ends() -> None:
    """The shared builder thread (compiled/delegate_support.py) ends whatever its work raises,
    so a delegate's aclose, which waits for it, never waits forever."""
    from asyncgraph.compiled.delegate_support import BuilderThread

    def work() -> None:
        raise RuntimeError("an unexpected error in a build")

    builder = BuilderThread()
    with builder.lock:
        assert builder.start(work, "asyncgraph-test-builder")
    assert builder.wait_idle(10), "the builder thread was left running"
    assert not builder.running
