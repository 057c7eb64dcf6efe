"""The AOTInductor fast form (asyncgraph/compiled/aoti_form.py): the exported program compiled
in a child process, kept on disk, loaded on the Executor's weights and measured beside the
other forms."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.compiled import aoti_form
from asyncgraph.compiled import package as package_module
from asyncgraph.compiled.aoti_form import FormRefused
from asyncgraph.compiled.export_cache import environment
from asyncgraph.graph.importers import Program, from_exported_program
from asyncgraph.plugins import _aoti_missing
from asyncgraph.runtime.disk_cache import digest
from asyncgraph.runtime.form_verdicts import KIND
from tests.support.models import DeepMLP as MLP
from tests.support.models import export_model

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(600)]
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                                    reason="AOTInductor needs a C++ compiler (g++)")
FAST = ExecutorConfig(fast_paths=True)
# a compile is tens of seconds of CPU: once per test, on asyncio (the loop plays no part in it)
compiles = pytest.mark.asyncio(loop_factories=["asyncio"])


@pytest.fixture
def aoti_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The AOTInductor form turned on, its cache in `tmp_path`, compiled with the default
    kernels (autotuning adds minutes of compile)."""
    monkeypatch.setenv("ASYNCGRAPH_AOTI_FORM", "1")
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(aoti_form, "AUTOTUNE", False)
    return tmp_path


def _package_path(cache: Path, ep: Any) -> Path:
    """Where the form of `ep` is kept (aoti_form.py's key, with AUTOTUNE off)."""
    described = from_exported_program(ep).graph.described()
    return cache / "aoti" / f"{digest('aoti', environment(), described, 1, False)}.pt2"


def _compiles(children: list[Any]) -> int:
    return sum("asyncgraph.compiled.aoti_form" in child.args for child in children)


async def _until_built(ex: Executor, model: torch.nn.Module, x: torch.Tensor,
                       decided: bool = False) -> dict[str, Any]:
    """Executions, each checked against eager, until the build has ended (and with `decided`,
    the signature's verdict alone is reached)."""
    expected = model(x)
    while True:
        torch.testing.assert_close(await ex.execute(x), expected, rtol=1e-4, atol=1e-5)
        forms = ex.statistics().forms
        assert forms is not None
        verdict = next(iter(forms["signatures"].values()), {}).get("alone", {})
        if forms["state"] != "building" and (not decided or verdict["form"] != "measuring"):
            return forms
        await anyio.sleep(0.01)


@needs_compiler
@compiles
async def test_the_aoti_form_is_compiled_in_a_child_kept_and_measured_beside_the_others(
    aoti_on: Path, children: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    archive_loads: list[Path] = []  # the package's own program decoded (torch.export.load)
    load_source = package_module.load_source_program
    monkeypatch.setattr(package_module, "load_source_program",
                        lambda path: archive_loads.append(path) or load_source(path))
    model, x = MLP().eval(), torch.randn(1, 32)
    ep = export_model(model, x)
    async with Executor(ep, FAST) as ex:
        forms = await _until_built(ex, model, x, decided=True)
    assert "aoti" in forms["forms"] and "aoti" not in forms["passed"], forms
    (verdicts,) = forms["signatures"].values()
    assert " aoti " in verdicts["alone"]["why"], verdicts  # timed with the others
    assert _compiles(children) == 1 and all(child.poll() is not None for child in children)
    (package,) = (aoti_on / "aoti").glob("*.pt2")
    assert stat.S_IMODE(package.stat().st_mode) == 0o600

    # a restart builds only the backends the kept verdicts chose a form of; where they chose
    # none (the plain graph won), every form, to measure again: never a compile
    chosen = {verdicts[regime]["form"] for regime in ("alone", "loaded")} - {"plain",
                                                                            "measuring"}
    async with Executor(ep, FAST) as restarted:
        forms = await _until_built(restarted, model, x)
    assert _compiles(children) == 1
    assert ("aoti" in forms["forms"]) == (not chosen or any(f.startswith("aoti")
                                                            for f in chosen)), (
        chosen, forms["forms"])

    shutil.rmtree(aoti_on / KIND)  # without kept verdicts every form is built: it loads
    async with Executor(ep, FAST) as restarted:
        forms = await _until_built(restarted, model, x)
    assert "aoti" in forms["forms"] and _compiles(children) == 1
    # the package's segments spliced into the Executor's own program, which the manifest
    # names: its copy in the archive is never decoded
    assert archive_loads == []

    # the same model exported with a dynamic batch is another package; one compiled for a
    # static batch, found under its name, is refused (it would answer a batch of 5 with 1 row)
    dynamic = export_model(model, torch.randn(2, 32), dynamic=True)
    planted = _package_path(aoti_on, dynamic)
    assert planted != package
    shutil.copy(package, planted)
    async with Executor(dynamic, FAST) as ex:
        forms = await _until_built(ex, model, torch.randn(5, 32))
    assert "aoti" not in forms["forms"]
    assert "was compiled for other inputs than the program's" in forms["passed"]["aoti"]
    assert archive_loads == [planted]  # not the program held: the archive's own is read


@needs_compiler
@compiles
async def test_a_swap_before_the_build_runs_the_form_on_the_new_weights(
    aoti_on: Path
) -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    async with Executor(export_model(model, x), FAST) as ex:
        # new weights of the same scale (std 1 would make activations of hundreds, where
        # float32 rounding alone is over the tolerance)
        new = {name: torch.randn_like(t) * 0.15 for name, t in model.state_dict().items()}
        ex.swap_weights(new)
        model.load_state_dict(new)
        forms = await _until_built(ex, model, x, decided=True)  # each checked against eager
    assert "aoti" in forms["forms"], forms


@needs_compiler
@compiles
async def test_a_cached_package_others_may_write_is_not_loaded(
    aoti_on: Path, children: list[Any]
) -> None:
    model, x = MLP().eval(), torch.randn(1, 32)
    ep = export_model(model, x)
    planted = _package_path(aoti_on, ep)
    planted.parent.mkdir(mode=0o755)
    planted.write_bytes(b"not a package")
    planted.chmod(0o666)
    async with Executor(ep, FAST) as ex:
        forms = await _until_built(ex, model, x)
    assert "aoti" not in forms["forms"]
    assert "writable by others" in forms["passed"]["aoti"], forms["passed"]
    assert _compiles(children) == 0


@needs_compiler
@compiles
async def test_closing_the_executor_stops_the_compile(
    aoti_on: Path, children: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="asyncgraph")
    model, x = MLP().eval(), torch.randn(1, 32)
    ex = Executor(export_model(model, x), FAST)
    await ex.execute(x)
    with anyio.fail_after(120):
        while not _compiles(children):
            await ex.execute(x)
            await anyio.sleep(0.01)
    await ex.aclose()
    assert all(child.poll() is not None for child in children)
    forms = ex.statistics().forms
    assert forms is not None and "the Executor closed" in forms["passed"]["aoti"]
    assert not list((aoti_on / "aoti").glob("*.pt2"))
    assert not [r for r in caplog.records if r.name.startswith("asyncgraph")], caplog.text


# -- without a compile ---------------------------------------------------------------------------


def test_the_form_needs_an_exported_program_and_one_thread() -> None:
    graph = from_exported_program(export_model(MLP(), torch.randn(1, 32))).graph
    with pytest.raises(FormRefused, match="not an ExportedProgram"):
        aoti_form.form_program(Program(graph), 1, 1)


def test_the_form_runs_on_the_packages_tensors_only_where_they_are_the_executors() -> None:
    current = {"w": torch.ones(2), "b": torch.zeros(2)}
    same = {"w": torch.ones(2), "b": torch.zeros(2)}
    assert all(a is b for a, b in zip(aoti_form._weights(current, same).values(),
                                      same.values(), strict=True))
    other = {"w": torch.ones(2), "b": torch.ones(2)}
    assert aoti_form._weights(current, other)["b"] is current["b"]
    with pytest.raises(FormRefused, match=r"weights \['w'\] are not the program's"):
        aoti_form._weights(current, {"w": torch.ones(2)})


def test_outputs_that_differ_are_named() -> None:
    t = torch.arange(4.0)
    assert aoti_form._outputs_differ([t, 3], [t.clone(), 3]) == ""
    assert "differs from the plain nodes' by up to 1" in aoti_form._outputs_differ([t + 1],
                                                                                    [t])
    assert aoti_form._outputs_differ([t, 4], [t, 3]).startswith("outputs ")
    assert aoti_form._outputs_differ([t], [t, t]).startswith("outputs ")


def test_what_keeps_the_aoti_backend_from_building(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ASYNCGRAPH_AOTI_FORM", "0")
    assert _aoti_missing() == "turned off by ASYNCGRAPH_AOTI_FORM=0"
    monkeypatch.setenv("ASYNCGRAPH_AOTI_FORM", "1")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert _aoti_missing() == "no C++ compiler (no-such-compiler-here) for AOTInductor"
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", "")
    assert "the disk cache is off" in (_aoti_missing() or "")
