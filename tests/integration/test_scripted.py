"""Scripted segments (ExecutorConfig(segments=("script",))): runs of aten nodes traced with
torch.jit.trace per input signature and run by TorchScript's interpreter."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from conformance.harness import assert_conforms, cached_export, imported
from conformance.models import CASES, CASES_BY_NAME, export_case

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.compiled import delegate_support, scripted
from asyncgraph.compiled.scripted import ScriptedDelegate
from tests.support.models import Chain, eager_output, export_model

pytestmark = pytest.mark.usefixtures("leak_check")

SCRIPTED = ExecutorConfig(segments=("script",))
CONFIGS = {
    "scripted": SCRIPTED,
    "scripted, parallel": ExecutorConfig(segments=("script",), max_parallel_ops=2,
                                         heavy_op_flops=0, ready_order_seed=7),
}


def _delegates(ex: Executor) -> list[ScriptedDelegate]:
    return [k.fn for k in ex.kernels if isinstance(k.fn, ScriptedDelegate)]


async def _settled(ex: Executor) -> ScriptedDelegate:
    """The executor's first delegate, once its tracer thread has traced what was asked."""
    delegates = _delegates(ex)
    for delegate in delegates:
        assert await anyio.to_thread.run_sync(delegate.wait_idle, 60), "a trace took > 60 s"
    return delegates[0]


@pytest.fixture(autouse=True)
def traces_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace serves its signature whatever its speed against the fx module (the per-segment
    choice has tests of its own, which set SLOWER_BY back): the tests here are of the traces."""
    monkeypatch.setattr(delegate_support, "TIMED_RUNS", 1)
    monkeypatch.setattr(delegate_support, "SLOWER_BY", float("inf"))


@pytest.fixture
def short_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Script runs of two nodes or more, so that the small corpus models have segments."""
    monkeypatch.setattr(scripted, "MIN_NODES", 2)


# -- the conformance corpus -----------------------------------------------------------------------


def _exported(name: str, decomposed: bool) -> Any:
    case = CASES_BY_NAME[name]
    return cached_export(("model", name, decomposed),
                         lambda: export_case(case, decomposed=decomposed))


_EXPORTABLE = [c for c in CASES if not c.architecture and c.skip is None
               and (c.export_limit is None or not c.export_limit.applies())]
# The corpus models whose graphs get scripted segments with runs of 2+ nodes (as exported; the
# decomposed graph of grad_and_autocast gets one too). The others run the plain graph either
# way, which tests/conformance already checks (custom_ops: its ops are not aten's).
_SCRIPTED = ("while_counter", "associative_scan", "vmap", "counter_buffer", "input_mutation",
             "batchnorm_train", "symbolic_arithmetic", "unbacked_item", "aliased_outputs",
             "nested_pytrees", "parameter_output")


def _has_segments(ex: Executor) -> None:
    assert ex.scripted, "no scripted segment: the corpus test checks nothing scripted here"


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize(("name", "decomposed"), [
    *((name, False) for name in _SCRIPTED),
    *((c.name, True) for c in _EXPORTABLE if c.decompose
      and c.name in (*_SCRIPTED, "grad_and_autocast")),
])
async def test_the_conformance_corpus_conforms_scripted(
    name: str, decomposed: bool, short_runs: None
) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*were assigned during export.*")
        ep = _exported(name, decomposed)
    outcome = await assert_conforms(ep, CASES_BY_NAME[name].calls(), configs=CONFIGS,
                                    check=_has_segments)
    assert outcome.both_raised == 0


async def test_most_of_the_corpus_gets_scripted_segments(short_runs: None) -> None:
    """The corpus test above covers scripting only where segments form: most models have one."""
    scripted_cases = []
    for case in _EXPORTABLE:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*were assigned during export.*")
            graph = imported(_exported(case.name, False)).graph
        if scripted.script_segments(graph)[1]:
            scripted_cases.append(case.name)
    assert len(scripted_cases) >= len(_EXPORTABLE) // 2, (scripted_cases, len(_EXPORTABLE))
    assert set(_SCRIPTED) <= set(scripted_cases)  # the corpus test above covers these


# -- what scripting promises ----------------------------------------------------------------------


async def test_one_segment_replaces_the_run_and_matches_eager() -> None:
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        first = await ex.execute(x)  # the fx module runs it while the trace is made
        assert ex.scripted == ["scripted_segment_0"]
        delegate = await _settled(ex)
        assert len(delegate.node_names) >= 10
        out = await ex.execute(x)  # the trace
        stats = delegate.statistics()
    assert (stats["traced"], stats["calls"], stats["untraced_calls"]) == (1, 2, 1)
    torch.testing.assert_close(first, eager_output(model, x))
    torch.testing.assert_close(out, eager_output(model, x))


async def test_each_input_shape_is_traced_once() -> None:
    model = Chain()
    async with Executor(export_model(model, torch.randint(0, 50, (2, 5)), dynamic=True),
                        SCRIPTED) as ex:
        for batch in (2, 5, 2, 5, 1):
            x = torch.randint(0, 50, (batch, 5))
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = (await _settled(ex)).statistics()
    assert (stats["traced"], stats["signatures"], stats["calls"]) == (3, 3, 5)


def _delayed(seconds: float, run: Any) -> Any:
    def delayed(*inputs: Any) -> Any:
        time.sleep(seconds)
        return run(*inputs)
    return delayed


async def test_a_segment_that_torchscript_runs_slower_stays_on_its_fx_module_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The choice per segment and signature: timed against the fx module after its trace, a
    trace more than SLOWER_BY times slower leaves the signature on the fx module;
    `statistics()["serves"]` says what serves it and the medians measured."""
    monkeypatch.setattr(delegate_support, "SLOWER_BY", 1.25)
    monkeypatch.setattr(delegate_support, "TIMED_RUNS", 3)
    trace = scripted._TRACE
    monkeypatch.setattr(scripted, "_TRACE", lambda *a, **k: _delayed(0.05, trace(*a, **k)))
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        await ex.execute(x)
        delegate = await _settled(ex)
        started = time.perf_counter()
        out = await ex.execute(x)  # the fx module: well under the trace's 50 ms
        elapsed = time.perf_counter() - started
        stats = delegate.statistics()
    torch.testing.assert_close(out, eager_output(model, x))
    assert elapsed < 0.05
    assert (stats["traced"], stats["signatures"], stats["calls"]) == (1, 1, 2)
    ((trace_s, plain_s),) = delegate.timed.values()
    assert trace_s >= 0.05 > 1.25 * plain_s
    (said,) = stats["serves"].values()
    assert said == (f"plain: the plain nodes ran faster: {plain_s * 1e6:.0f} us against "
                    f"TorchScript's {trace_s * 1e6:.0f} us (medians of 3 runs each, "
                    "alternating)")
    assert list(stats["serves"]) == ["['(3, 5) int64 cpu']"]


async def test_a_segment_that_torchscript_runs_faster_keeps_its_trace_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(delegate_support, "SLOWER_BY", 1.25)
    monkeypatch.setattr(delegate_support, "TIMED_RUNS", 3)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        (delegate,) = _delegates(ex)
        monkeypatch.setattr(delegate.module, "forward", _delayed(0.05, delegate.module.forward))
        await ex.execute(x)  # the fx module, 50 ms slower, while the trace is made
        await _settled(ex)
        started = time.perf_counter()
        out = await ex.execute(x)  # the trace
        elapsed = time.perf_counter() - started
        stats = delegate.statistics()
    torch.testing.assert_close(out, eager_output(model, x))
    assert elapsed < 0.05
    ((trace_s, plain_s),) = delegate.timed.values()
    assert plain_s >= 0.05 > trace_s
    (said,) = stats["serves"].values()
    assert said == f"script: {trace_s * 1e6:.0f} us against the plain nodes' {plain_s * 1e6:.0f} us"


async def test_a_refused_trace_says_why_its_signature_runs_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer says no")

    monkeypatch.setattr(scripted, "_TRACE", refuse)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        await ex.execute(x)
        stats = (await _settled(ex)).statistics()
    assert list(stats["serves"].values()) == ["plain: the tracer refused: RuntimeError: "
                                              "tracer says no"]


async def test_the_oldest_trace_is_dropped_beyond_max_traces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = Chain()
    async with Executor(export_model(model, torch.randint(0, 50, (2, 5)), dynamic=True),
                        SCRIPTED) as ex:
        (delegate,) = _delegates(ex)
        delegate.max_traces = 2
        for batch in (1, 2, 3, 1):
            x = torch.randint(0, 50, (batch, 5))
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
            await _settled(ex)
        stats = delegate.statistics()
    assert (stats["traced"], stats["signatures"], stats["dropped"]) == (4, 2, 2)
    assert len(stats["serves"]) == 2 and len(delegate.timed) == 2  # forgotten with the trace


async def test_concurrent_executions_on_workers_trace_each_shape_once() -> None:
    model = Chain()
    config = ExecutorConfig(segments=("script",), max_parallel_ops=2, heavy_op_flops=0,
                            adaptive_placement=False)
    async with Executor(export_model(model, torch.randint(0, 50, (2, 5)), dynamic=True),
                        config) as ex:
        xs = [torch.randint(0, 50, (1 + i % 3, 5)) for i in range(24)]
        outs = await asyncio.gather(*(ex.execute(x) for x in xs))
        stats = (await _settled(ex)).statistics()
        assert ex.statistics().workers.items_run >= 24  # the segment ran on worker threads
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, eager_output(model, x))
    assert (stats["traced"], stats["signatures"]) == (3, 3)


async def test_a_weights_swap_reaches_the_traces_without_tracing_again() -> None:
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        before = await ex.execute(x)
        await _settled(ex)
        new = {"linear.weight": torch.randn(16, 16), "embed.weight": torch.randn(50, 16)}
        ex.swap_weights(new)
        after = await ex.execute(x)
        traced = _delegates(ex)[0].statistics()["traced"]
    model.load_state_dict(new, strict=False)
    torch.testing.assert_close(after, eager_output(model, x))
    assert not torch.allclose(before, after)
    assert traced == 1


async def test_a_failing_call_names_the_aten_node_that_failed() -> None:
    model = Chain()
    async with Executor(export_model(model, torch.randint(0, 50, (3, 5)), dynamic=True),
                        SCRIPTED) as ex:
        for shape in ((2, 5), (3, 5)):  # the first call of a signature, then a traced one
            if shape == (3, 5):
                await ex.execute(torch.randint(0, 50, shape))
                await _settled(ex)
            with pytest.raises(IndexError, match="index out of range") as caught:
                await ex.execute(torch.full(shape, 99))  # ids past the embedding's 50 rows
            notes = "\n".join(getattr(caught.value, "__notes__", []))
            assert "%embedding = aten.embedding" in notes, notes
            assert "scripted_segment_0" in notes, notes
        (delegate,) = _delegates(ex)
        assert delegate.statistics()["traced"] == 1  # the failed first call traced nothing
        x = torch.zeros(2, 5, dtype=torch.long)
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = (await _settled(ex)).statistics()
    assert (stats["traced"], stats["untraceable"]) == (2, "")  # (2, 5) traced on its next call


async def test_a_run_the_tracer_refuses_runs_as_its_fx_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("tracer says no\nsecond line")

    monkeypatch.setattr(scripted, "_TRACE", refuse)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        out = await ex.execute(x)
        await _settled(ex)
        again = await ex.execute(x)
        stats = _delegates(ex)[0].statistics()
    torch.testing.assert_close(out, eager_output(model, x))
    torch.testing.assert_close(again, eager_output(model, x))
    assert stats["untraceable"] == "RuntimeError: tracer says no"
    assert (stats["traced"], stats["signatures"], stats["untraced_calls"]) == (0, 1, 1)


async def test_a_new_shape_is_traced_off_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Executions go on (the fx module runs them) while the tracer thread traces; the trace
    works on copies of the inputs, which the caller may overwrite at once."""
    release, tracing_threads = threading.Event(), []
    trace = scripted._TRACE

    def slow_trace(*args: Any, **kwargs: Any) -> Any:
        tracing_threads.append(threading.current_thread().name)
        assert release.wait(60)
        return trace(*args, **kwargs)

    monkeypatch.setattr(scripted, "_TRACE", slow_trace)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    expected = eager_output(model, x)
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        for _ in range(3):  # the trace is held: the fx module runs each of these
            torch.testing.assert_close(await ex.execute(x.clone()), expected)
        (delegate,) = _delegates(ex)
        assert delegate.statistics()["pending"] == 1 and delegate.statistics()["traced"] == 0
        x_used = x.clone()
        await ex.execute(x_used)
        x_used.fill_(99)  # past the embedding: a trace on the caller's tensor would fail
        release.set()
        await _settled(ex)
        torch.testing.assert_close(await ex.execute(x), expected)
        stats = delegate.statistics()
    assert tracing_threads == ["asyncgraph-trace-scripted_segment_0"]
    assert (stats["traced"], stats["untraceable"], stats["pending"]) == (1, "", 0)
    assert (stats["calls"], stats["untraced_calls"]) == (5, 4)


async def test_aclose_waits_for_the_trace_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leak check after it fails if a tracer thread outlives the Executor."""
    started, release = threading.Event(), threading.Event()
    trace = scripted._TRACE

    def slow_trace(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert release.wait(60)
        return trace(*args, **kwargs)

    monkeypatch.setattr(scripted, "_TRACE", slow_trace)
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    ex = Executor(export_model(model, x), SCRIPTED)
    await ex.execute(x)
    assert await anyio.to_thread.run_sync(started.wait, 60)
    asyncio.get_running_loop().call_later(0.05, release.set)
    await ex.aclose()
    (delegate,) = _delegates(ex)
    assert release.is_set() and delegate.wait_idle(0)


class _AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + 1,)


def test_a_trace_refused_without_a_message_ends_the_tracer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tracer thread records why a trace was refused and ends, whatever the message: an
    exception whose text is empty must not kill it with its signature still pending (then
    wait_idle, and an Executor's aclose, would wait for it forever)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError()

    monkeypatch.setattr(scripted, "_TRACE", refuse)
    delegate = ScriptedDelegate("segment", torch.fx.symbolic_trace(_AddOne()), [0], ["add"])
    torch.testing.assert_close(delegate(torch.ones(2)), [torch.full((2,), 2.0)])
    assert delegate.wait_idle(10), "the tracer thread did not end"
    stats = delegate.statistics()
    assert (stats["untraceable"], stats["pending"], stats["traced"]) == ("RuntimeError: ", 0, 0)


class DataDependent(torch.nn.Module):
    """A nonzero between two runs: its output's shape depends on x's values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(4):
            h = torch.relu(h * 2 - 1)
        idx = torch.nonzero(h > 0)
        g = idx.float()
        for _ in range(4):
            g = torch.sigmoid(g * 3 + 1)
        return g.sum(dim=0)


async def test_ops_with_data_dependent_shapes_stay_outside_the_traces(short_runs: None) -> None:
    model = DataDependent()
    x = torch.randn(4, 6)
    async with Executor(export_model(model, x), SCRIPTED) as ex:
        inside = {name for d in _delegates(ex) for name in d.node_names}
        assert inside and not any("nonzero" in name for name in inside)
        for seed in range(3):  # as many nonzeros as the values give: no trace may bake one in
            torch.manual_seed(seed)
            x = torch.randn(4, 6)
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))


async def test_off_by_default_and_short_runs_stay_interpreted() -> None:
    model, x = Chain(), torch.randint(0, 50, (3, 5))
    ep = export_model(model, x)
    async with Executor(ep) as plain, Executor(ep, SCRIPTED) as short:
        assert plain.scripted == [] and not _delegates(plain)
        assert short.scripted  # the Chain's run is long enough
    graph, names = scripted.script_segments(imported(ep).graph, min_nodes=10_000)
    assert names == [] and len(graph.nodes) == len(imported(ep).graph.nodes)


async def test_ops_that_write_or_are_not_aten_stay_outside_the_traces() -> None:
    """A new trace's warm-up calls run the segment twice: an in-place op would write twice;
    a custom op's Python kernel stays out of TorchScript's interpreter."""
    from asyncgraph.graph.ir import Node

    write = Node(0, "add_", torch.ops.aten.add_.Tensor, (), {}, 0)
    pure = Node(1, "add", torch.ops.aten.add.Tensor, (), {}, 1)
    custom = Node(2, "scaled_tanh", torch.ops.agconf.scaled_tanh.default, (), {}, 2)
    assert scripted.unscriptable_reason(write) == "aten.add_.Tensor writes to its arguments"
    assert scripted.unscriptable_reason(pure) is None
    assert scripted.unscriptable_reason(custom) == "agconf.scaled_tanh.default is not an aten op"


def test_the_cli_scripts_segments_on_request(tmp_path: Path) -> None:
    """`asyncgraph profile --script-segments` profiles the delegate in place of its nodes."""
    from typer.testing import CliRunner

    from asyncgraph.cli.main import app

    model, x = Chain(), torch.randint(0, 50, (3, 5))
    path = tmp_path / "chain.pt2"
    torch.export.save(export_model(model, x), path)
    args = ["profile", str(path), "--runs", "2", "--warmup", "0", "--json"]
    scripted_run = CliRunner().invoke(app, [*args, "--script-segments"])
    plain_run = CliRunner().invoke(app, args)
    assert scripted_run.exit_code == 0 and plain_run.exit_code == 0, scripted_run.output
    assert "scripted_segment_0" in scripted_run.output
    assert "scripted_segment_0" not in plain_run.output and "tanh" in plain_run.output
