"""Fast forms on a real program (ExecutorConfig.fast_paths, asyncgraph/runtime/forms.py): the
ONNX Runtime form is built off the loop, every output matches eager whichever form serves,
the verdict is measured, and a weights swap never serves the old weights."""

from __future__ import annotations

import asyncio
import itertools
import re
import shutil
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.runtime.disk_cache import cache_root
from asyncgraph.runtime.weights import weights_ran_on
from tests.support.models import DeepMLP as MLP
from tests.support.models import export_model

pytest.importorskip("onnxruntime", reason="the fast form needs the asyncgraph[onnxruntime] extra")
pytest.importorskip("onnxscript", reason="the fast form needs the asyncgraph[onnxruntime] extra")

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _no_kept_verdicts() -> None:
    """Each test measures its own verdicts: none kept from an earlier test of the process
    (the exports stay cached: they only save time)."""
    root = cache_root()
    if root is not None:
        shutil.rmtree(root / "forms", ignore_errors=True)

FAST = ExecutorConfig(fast_paths=True)


async def _until_decided(ex: Executor, model: torch.nn.Module, x: torch.Tensor,
                         limit_s: float = 60.0) -> dict[str, Any]:
    """Executions, each checked against eager, until the signature has a verdict (a first
    export runs in a child process: seconds)."""
    import anyio

    expected = model(x)
    with anyio.move_on_after(limit_s):
        for n in itertools.count():
            torch.testing.assert_close(await ex.execute(x), expected, rtol=1e-4, atol=1e-5)
            forms = ex.statistics().forms
            assert forms is not None
            verdicts = forms["signatures"].get(next(iter(forms["signatures"]), None), {})
            verdict = verdicts.get("alone", {})
            if verdict.get("form", "measuring") != "measuring":
                return forms
            if n % 16 == 0:
                await anyio.sleep(0.005)  # the build thread's turn
    pytest.fail(f"no verdict after {limit_s} s: {ex.statistics().forms}")


async def test_the_onnx_form_is_built_off_the_loop_and_chosen_by_measurement() -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    async with Executor(export_model(model, x), FAST) as ex:
        forms = await _until_decided(ex, model, x)
        assert forms["form"] == "onnx" and forms["builds"] == 1 and forms["passed"] == {}
        (verdicts,) = forms["signatures"].values()
        verdict = verdicts["alone"]
        assert verdict["why"].startswith("measured: onnx ")
        # per form, per segment and signature, what serves it and the medians that decided
        assert set(forms["segments"]) == set(forms["forms"])
        for segments in forms["segments"].values():
            ((signature, said),) = segments["onnx_segment_0"].items()
            assert signature == "[[1, 32]]"
            assert said.startswith(("onnx: ", "plain: the plain nodes ran faster: ")), said
            assert " us against " in said
        served = forms["fast_runs"]
        for _ in range(8):
            torch.testing.assert_close(await ex.execute(x), model(x), rtol=1e-4, atol=1e-5)
        after = ex.statistics().forms
        assert after is not None
        assert (after["fast_runs"] - served == 8) == (verdict["form"] != "plain")


async def test_after_a_weights_swap_every_output_is_the_new_weights() -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    async with Executor(export_model(model, x), FAST) as ex:
        await _until_decided(ex, model, x)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5)
        ex.swap_weights({f"layers.{k}.{w}": getattr(model.layers[k], w)
                         for k in range(0, 20, 2) for w in ("weight", "bias")})
        forms = await _until_decided(ex, model, x)  # checks each output on the new weights
        assert forms["builds"] == 2


async def test_an_execution_on_a_form_says_the_executors_weights_version() -> None:
    """A form is an Executor of its own, built on the swapped weights as its version 0: an
    execution it served noted that for its task, and a server labelled the answer with the
    version before the swap (serve/core.py's `Served.label(weights_ran_on())`)."""
    model, x = MLP().eval(), torch.randn(1, 32)
    async with Executor(export_model(model, x), FAST) as ex:
        await _until_decided(ex, model, x)
        version = ex.swap_weights({k: v * 0.5 for k, v in model.state_dict().items()})
        assert version == 1
        forms = ex.statistics().forms
        assert forms is not None
        fast_runs = forms["fast_runs"]
        for n in range(400):
            await ex.execute(x)
            assert weights_ran_on() == version
            forms = ex.statistics().forms
            assert forms is not None
            if forms["fast_runs"] > fast_runs + 20:
                break
            if n % 16 == 0:
                await asyncio.sleep(0.005)  # the build thread's turn
        assert forms["fast_runs"] > fast_runs + 20, forms  # the rebuilt form served


async def test_a_static_and_a_dynamic_batch_export_keep_their_verdicts_apart() -> None:
    """The same model exported with a static and a dynamic batch builds other forms (a
    dynamic AOTInductor package, ONNX sessions for any batch): a verdict one kept on disk
    must not choose, or limit the build of, the other's forms."""
    model, x = MLP().eval(), torch.randn(2, 32)
    files = set()
    static, dynamic = export_model(model, x), export_model(model, x, dynamic=True)
    for ep in (static, dynamic, export_model(model, x)):
        async with Executor(ep, FAST) as ex:
            assert ex._forms is not None and ex._forms._verdicts is not None
            files.add(ex._forms._verdicts.path)
    assert len(files) == 2


async def test_off_small_or_traced_programs_have_no_fast_forms() -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    ep = export_model(model, x)
    small = MLP(layers=2).eval()
    for ex in (Executor(ep, ExecutorConfig(fast_paths=False)),
               Executor(ep, ExecutorConfig(fast_paths=True, trace=True)),
               Executor(ep, ExecutorConfig(fast_paths=True, segments=("onnx",))),
               Executor(export_model(small, x), FAST)):
        async with ex:
            torch.testing.assert_close(await ex.execute(x), ex.program.reference(x))
            assert ex.statistics().forms is None


def test_the_environment_turns_the_default_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCGRAPH_FAST_PATHS", "off")
    assert ExecutorConfig().fast_paths is False
    monkeypatch.setenv("ASYNCGRAPH_FAST_PATHS", "1")
    assert ExecutorConfig().fast_paths is True
    monkeypatch.delenv("ASYNCGRAPH_FAST_PATHS")
    assert ExecutorConfig().fast_paths is True


async def test_many_callers_while_the_form_builds_and_after() -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    xs = [torch.randn(1, 32) for _ in range(64)]
    async with Executor(export_model(model, x), FAST) as ex:
        for _ in range(6):
            outs = await asyncio.gather(*(ex.execute(v) for v in xs))
            for v, out in zip(xs, outs, strict=True):
                torch.testing.assert_close(out, model(v), rtol=1e-4, atol=1e-5)
            await asyncio.sleep(0.05)
        await _until_decided(ex, model, x)


async def test_closing_during_a_first_export_stops_it_quietly(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    children: list[Any],
) -> None:
    """A fast form's first export runs in a child process; an Executor closed meanwhile
    stops the child and leaves no thread, no process and no warning behind."""
    import logging

    from asyncgraph.compiled import onnx_export

    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", str(tmp_path))  # nothing exported yet
    monkeypatch.setattr(onnx_export, "_CACHE", type(onnx_export._CACHE)())
    started = children
    model, x = MLP().eval(), torch.randn(1, 32)
    caplog.set_level(logging.WARNING, logger="asyncgraph")
    ex = Executor(export_model(model, x), FAST)
    torch.testing.assert_close(await ex.execute(x), model(x), rtol=1e-4, atol=1e-5)
    for _ in range(3000):  # until the build thread has started its child (30 s at most)
        if started:
            break
        await asyncio.sleep(0.01)
    await ex.aclose()
    assert started and all(child.poll() is not None for child in started)
    assert ex.statistics().forms is not None and ex.statistics().forms["form"] is None
    assert not [r for r in caplog.records if r.name.startswith("asyncgraph")], caplog.text


def test_the_fast_form_serves_on_trio_and_asyncio(backend: str) -> None:
    """The form is an Executor bound to the caller's loop the first time it serves: on trio
    too, where executions run in cancel scopes, and aclose(cancel=True) reaches its callers."""
    import anyio

    from tests.support.backends import run

    async def body() -> None:
        model, x = MLP().eval(), torch.randn(1, 32)
        ex = Executor(export_model(model, x), FAST)
        try:
            forms = await _until_decided(ex, model, x)
            assert forms["form"] == "onnx"
            async with anyio.create_task_group() as group:
                for _ in range(16):
                    group.start_soon(ex.execute, x)
        finally:
            await ex.aclose(cancel=True)
        assert ex.statistics().closed

    run(body, backend)


def test_asyncgraph_profile_says_what_serves_on_the_default_path(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`asyncgraph profile` traces node by node, which the fast form never serves: it also
    runs the default path until its verdict and says which form serves these inputs, why."""
    import json

    from typer.testing import CliRunner

    from asyncgraph.cli.main import app

    monkeypatch.setenv("ASYNCGRAPH_FAST_PATHS", "1")
    model, x = MLP().eval(), torch.randn(1, 32)
    path = tmp_path / "mlp.pt2"
    torch.export.save(export_model(model, x), path)
    runner = CliRunner()
    shown = runner.invoke(app, ["profile", str(path), "--runs", "2", "--warmup", "0"])
    assert shown.exit_code == 0, shown.output
    assert "default path: " in shown.output and "serves these inputs alone: " in shown.output
    assert "segment onnx_segment_0, inputs [[1, 32]]: " in shown.output
    printed = runner.invoke(app, ["profile", str(path), "--runs", "2", "--json"])
    assert printed.exit_code == 0, printed.output
    forms = json.loads(printed.stdout)["forms"]
    (verdicts,) = forms["signatures"].values()
    verdict = verdicts["alone"]  # profile runs one execution at a time
    assert verdict["form"] in ("onnx", "onnx, 2 threads", "plain")
    assert verdict["why"].startswith("kept from an earlier run here: measured: ")  # the first
    assert verdicts["loaded"]["form"] == "measuring"
    monkeypatch.setenv("ASYNCGRAPH_FAST_PATHS", "0")
    off = runner.invoke(app, ["profile", str(path), "--runs", "1", "--json"])
    assert json.loads(off.stdout)["forms"] is None


async def test_a_restart_serves_the_kept_form_from_its_first_request() -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    ep = export_model(model, x)
    async with Executor(ep, FAST) as first:
        forms = await _until_decided(first, model, x)
    chosen = next(iter(forms["signatures"].values()))["alone"]["form"]
    async with Executor(ep, FAST) as restarted:
        started = restarted.statistics().forms
        assert started is not None and started["kept"] >= 1
        fast = chosen != "plain"
        assert started["state"] == ("building" if fast else "none") or (
            fast and started["state"] == "ready")
        torch.testing.assert_close(await restarted.execute(x), model(x), rtol=1e-4, atol=1e-5)
        after = restarted.statistics().forms
        assert after is not None
        assert after["fast_runs"] == (1 if fast else 0)  # the very first request
        verdict = next(iter(after["signatures"].values()))["alone"]
        assert verdict["form"] == chosen and verdict["why"].startswith("kept from an earlier")


async def test_many_callers_reach_a_verdict_under_load() -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    xs = [torch.randn(1, 32) for _ in range(64)]
    expected = [model(v) for v in xs]
    async with Executor(export_model(model, x), FAST) as ex:
        for _ in range(400):
            outs = await asyncio.gather(*(ex.execute(v) for v in xs))
            for out, want in zip(outs, expected, strict=True):
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
            forms = ex.statistics().forms
            assert forms is not None
            loaded = next(iter(forms["signatures"].values()), {}).get("loaded", {})
            if loaded.get("form", "measuring") != "measuring":
                break
            await asyncio.sleep(0.005)
        assert loaded.get("form", "measuring") != "measuring", forms
        assert "under load" in loaded["why"]


async def test_a_form_is_built_on_its_executors_passes_not_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph passes run once, for the Executor; its forms start from their result (the
    passes were most of a form's Python on the build thread, which the loop waited for)."""
    from asyncgraph.runtime import build

    runs = []
    run_passes = build.run_passes
    monkeypatch.setattr(build, "run_passes", lambda *a: runs.append(1) or run_passes(*a))
    model = MLP().eval()
    async with Executor(export_model(model, torch.randn(1, 32)), FAST) as ex:
        form = ex._build_form("onnx", 1)
        try:
            assert len(runs) == 1  # the Executor's own
            assert form.has_delegates
            assert form.lowered_linears == ex.lowered_linears > 0
            x = torch.randn(1, 32)
            torch.testing.assert_close(await form.execute(x), model(x), rtol=1e-4, atol=1e-5)
        finally:
            await form.aclose()


def test_the_onnx_runtime_starts_once_per_process() -> None:
    """start_runtime makes ONNX Runtime's first session (the one that holds the GIL for tens
    of milliseconds) when an Executor that may build an ONNX form is made, not later."""
    from asyncgraph.compiled import onnx_delegate

    onnx_delegate.start_runtime()
    assert onnx_delegate._started
    made = []
    real = onnx_delegate.ort.InferenceSession
    try:
        onnx_delegate.ort.InferenceSession = lambda *a, **k: made.append(1) or real(*a, **k)
        onnx_delegate.start_runtime()
    finally:
        onnx_delegate.ort.InferenceSession = real
    assert made == []  # once per process


async def test_a_one_call_form_takes_more_frames() -> None:
    """A form that is one ONNX call holds only an execution's inputs and outputs in a frame,
    so it takes ONE_CALL_FRAMES times the Executor's bound; a graph of many nodes (the plain
    one here) is no such call, and keeps the bound, since its frames hold intermediates."""
    from asyncgraph.runtime.executor import ONE_CALL_FRAMES

    model = MLP().eval()
    config = ExecutorConfig(fast_paths=True, max_concurrent_executions=3)
    async with Executor(export_model(model, torch.randn(1, 32)), config) as ex:
        form = ex._build_form("onnx", 1)
        try:
            assert form._one_delegate_call()
            assert form.statistics().frames.max_frames == 3 * ONE_CALL_FRAMES
        finally:
            await form.aclose()
    assert not ex._one_delegate_call()  # the plain graph: many nodes, no delegate


async def test_a_program_onnx_cannot_take_gets_the_scripted_form(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast forms are tried in order, and the first that builds serves: where the ONNX
    backend fails (an export it cannot do), the scripted segments are the form measured
    against the plain graph, with ONNX's reason in statistics()."""
    from asyncgraph.runtime import delegates

    def refuses(graph: Any, config: Any) -> Any:
        raise RuntimeError("torch.onnx cannot export aten.fancy_op")

    onnx = delegates._BACKENDS["onnx"]
    monkeypatch.setitem(delegates._BACKENDS, "onnx", delegates.SegmentBackend(
        "onnx", lambda: refuses, fast_form=True, missing=onnx.missing))
    model = MLP().eval()
    x = torch.randn(1, 32)
    async with Executor(export_model(model, x), FAST) as ex:
        await _until_decided(ex, model, x)
        forms = ex.statistics().forms
        assert forms is not None
        assert forms["form"] == "script"
        assert "torch.onnx cannot export aten.fancy_op" in forms["passed"]["onnx"]
        assert ex.segments == {}  # the Executor itself stays the plain graph
        # each scripted segment says, per signature, whether its trace or its nodes serve it
        segments = forms["segments"]["script"]
        assert segments, forms
        for said in segments.values():
            (serves,) = said.values()
            assert re.fullmatch(r"script: \d+ us against the plain nodes' \d+ us|plain: the "
                                r"plain nodes ran faster: .*", serves), serves


class CountingMLP(MLP):
    """An MLP that counts its calls in a buffer (a program that writes a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return super().forward(x) + self.count


async def test_a_program_that_writes_a_buffer_gets_no_form() -> None:
    """Each execution of it makes a new weights version, which no form built before serves: it
    would be built again and again, never serving, each build kept until close. The plain
    graph serves it, counting as eager does."""
    model, x = CountingMLP().eval(), torch.randn(1, 32)
    reference = CountingMLP().eval()
    reference.load_state_dict(model.state_dict())
    async with Executor(export_model(model, x), FAST) as ex:
        assert ex.statistics().forms is None
        for _ in range(3):
            torch.testing.assert_close(await ex.execute(x), reference(x))


async def test_a_decided_verdict_is_measured_again_under_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past RECHECK_RUNS executions and RECHECK_S, a loaded verdict is measured again on the
    real forms, every output still eager's, and the new verdict says what it replaced."""
    from asyncgraph.runtime import forms as forms_module

    monkeypatch.setattr(forms_module, "RECHECK_RUNS", 64)
    monkeypatch.setattr(forms_module, "RECHECK_S", 0.0)
    model, x = MLP().eval(), torch.randn(1, 32)
    xs = [torch.randn(1, 32) for _ in range(32)]
    expected = [model(v) for v in xs]

    def loaded() -> dict[str, str]:
        forms = ex.statistics().forms
        assert forms is not None
        return next(iter(forms["signatures"].values()), {}).get("loaded", {})

    async with Executor(export_model(model, x), FAST) as ex:
        seen: list[str] = []
        for _ in range(800):
            outs = await asyncio.gather(*(ex.execute(v) for v in xs))
            for out, want in zip(outs, expected, strict=True):
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
            why = loaded().get("why", "")
            if not seen or seen[-1] != why:
                seen.append(why)
            if "measured again (1)" in why:
                break
            await asyncio.sleep(0.002)
        assert any(w.startswith("measuring again (1), ") for w in seen), seen
        assert "measured again (1), " in loaded()["why"], seen
