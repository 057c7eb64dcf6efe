"""Model control's hot swaps and reload detection: which loads swap weights, which rebuild,
what a response's `model_version` is served with, and which file changes a load sees.

- Two versions whose programs differ only inside a `torch.cond` branch are different
  programs: the new one is rebuilt, never swapped into the old one's Executor.
- A load that swaps several versions never answers a request labelled with one version with
  another's weights: the swaps and the routing change in one step.
- A file replaced with one of the same size and the same modification time (`cp -p`,
  `rsync -a`, builds with fixed timestamps) is seen and reloaded.
- A load that fails in the middle of its swaps leaves every version serving as it was, and
  closes every Executor it made.

The folds of a swap are held or failed by patching ConstantFolder.__call__ (`FoldGate`), so
each window is as wide as the test needs, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import asyncgraph
from asyncgraph import Executor, ExecutorClosedError
from asyncgraph.passes.folding import ConstantFolder
from asyncgraph.serve import create_app, running_server
from asyncgraph.serve.model_control import ModelControl, add_model_control
from asyncgraph.serve.repository import ModelRepository, VersionPolicy
from tests.support.models import Affine, Scaled, export_model
from tests.support.serving import WAIT_S, eventually

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(120)]

X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8 - 0.4


def _export(model: torch.nn.Module, path: Path) -> np.ndarray:
    """Save `model` exported with a dynamic batch; return its eager output for X."""
    model.eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's tracing warnings; tests run with -W error
        ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, path)
    with torch.no_grad():
        out: np.ndarray = model(torch.from_numpy(X)).numpy()
    return out


class Branchy(torch.nn.Module):
    """A Linear(4, 3), then a torch.cond whose true branch is `activation` (relu or sigmoid):
    versions with other activations differ only inside the branch."""

    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        out: torch.Tensor = torch.cond(h.sum() > -100, self.activation, torch.neg, (h,))
        return out


class Files:
    """The module's .pt2 files and their outputs for X: `affine[i]`, Affine with seed i;
    `relu`, `sigmoid` (the same weights) and `relu_other` (other weights): Branchy."""

    def __init__(self, root: Path) -> None:
        self.affine: list[tuple[Path, np.ndarray]] = []
        for seed in range(4):
            torch.manual_seed(seed)
            path = root / f"affine{seed}.pt2"
            self.affine.append((path, _export(Affine(), path)))
        self.branchy: dict[str, tuple[Path, np.ndarray]] = {}
        for name, seed, activation in [("relu", 0, torch.relu), ("sigmoid", 0, torch.sigmoid),
                                       ("relu_other", 1, torch.relu)]:
            torch.manual_seed(seed)
            path = root / f"{name}.pt2"
            self.branchy[name] = (path, _export(Branchy(activation), path))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("pt2"))


def put(repo: Path, version: int, source: Path) -> Path:
    """Copy `source` into the repository as model `a`'s `version` (Triton's folder layout)."""
    target = repo / "a" / str(version) / "model.pt2"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


class Loader:
    """asyncgraph.load, keeping every Executor it made; `after_load(count)` runs on the
    loading thread after each load, with the number of loads so far. The requests of a held
    file's Executors wait before they execute (before the weights are read)."""

    def __init__(self) -> None:
        self.made: list[asyncgraph.Executor] = []
        self.after_load: Callable[[int], None] | None = None
        self.holds: dict[Path, asyncio.Event] = {}
        self.held = 0

    def hold(self, path: Path) -> asyncio.Event:
        event = self.holds[path] = asyncio.Event()
        return event

    def __call__(self, path: Path) -> asyncgraph.Executor:
        executor = asyncgraph.load(path)
        self.made.append(executor)
        hold = self.holds.get(path)
        if hold is not None:
            real = executor.execute_flat

            async def execute_flat(inputs: Any) -> list[Any]:
                self.held += 1
                await hold.wait()
                return await real(inputs)

            executor.execute_flat = execute_flat  # type: ignore[method-assign]
        if self.after_load is not None:
            self.after_load(len(self.made))
        return executor


class FoldGate:
    """ConstantFolder.__call__ watched: once armed, the `at`-th fold on a thread other than
    the loop's (a swap's fold) is held until `release`, or fails."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_thread = threading.current_thread()
        self.armed_at: int | None = None
        self.fail = False
        self.folds = 0  # folds on threads since armed
        self.held = asyncio.Event()
        self.release = threading.Event()

    def arm(self, at: int, *, fail: bool = False) -> None:
        self.armed_at, self.fail, self.folds = at, fail, 0

    def disarm(self) -> None:
        self.armed_at = None
        self.release.set()

    def entered(self) -> None:
        if self.armed_at is None or threading.current_thread() is self.loop_thread:
            return
        self.folds += 1
        if self.folds != self.armed_at:
            return
        if self.fail:
            raise RuntimeError("injected: the fold of the second swap failed")
        self.loop.call_soon_threadsafe(self.held.set)
        assert self.release.wait(WAIT_S), "the test never released the fold"

    async def wait_held(self) -> None:
        async with asyncio.timeout(WAIT_S):
            await self.held.wait()


@pytest.fixture
async def fold_gate(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FoldGate]:
    gate = FoldGate(asyncio.get_running_loop())
    fold = ConstantFolder.__call__

    def watched(self: ConstantFolder, tensors: Mapping[str, Any]) -> dict[str, Any]:
        gate.entered()
        return fold(self, tensors)

    monkeypatch.setattr(ConstantFolder, "__call__", watched)
    yield gate
    gate.disarm()


class Served:
    def __init__(self, control: ModelControl, http: httpx.AsyncClient, loader: Loader) -> None:
        self.control, self.http, self.loader = control, http, loader

    async def infer(self, version: str = "") -> tuple[str, np.ndarray] | None:
        """Model `a`'s answer to X: (its model_version, its output), or None for a 404 (a
        version not loaded)."""
        path = "/v2/models/a" + (f"/versions/{version}" if version else "") + "/infer"
        response = await self.http.post(path, json={"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": X.reshape(-1).tolist()}
        ]})
        if response.status_code == 404 and version:
            return None
        assert response.status_code == 200, response.text
        body = response.json()
        out = body["outputs"][0]
        return body["model_version"], np.asarray(out["data"], np.float32).reshape(out["shape"])

    async def load(self) -> httpx.Response:
        return await self.http.post("/v2/repository/models/a/load")

    def executor(self, version: int) -> asyncgraph.Executor:
        return self.control.loaded["a"][version].served.executor


@asynccontextmanager
async def serving(repo: Path, loader: Loader, policy: str = "latest:1") -> AsyncIterator[Served]:
    """Model `a` of `repo` served (explicit model control, loaded at start) over HTTP."""
    app = create_app({}, calibrate=False)
    control = add_model_control(app, ModelRepository(repo, VersionPolicy.parse(policy)), loader,
                                explicit=True, calibrate=False)
    control.preload(["a"])
    async with (
        running_server(app) as url,
        httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http,
    ):
        yield Served(control, http, loader)


def check_labels(answers: list[tuple[str, np.ndarray]], outputs: dict[str, np.ndarray]) -> None:
    """Every answer carries the output of the version it is labelled with."""
    wrong = [label for label, out in answers
             if not np.allclose(out, outputs[label], rtol=1e-5, atol=1e-6)]
    assert not wrong, (
        f"{len(wrong)} of {len(answers)} answers carry another version's output than the "
        f"version they are labelled with (labels {sorted(set(wrong))})"
    )


# -- what is a swap ----------------------------------------------------------------------------


async def test_a_version_whose_cond_branch_changed_is_rebuilt_not_swapped(
    tmp_path: Path, files: Files
) -> None:
    """relu -> sigmoid inside the branch, the same weights: another program. Served with
    version 1's branch, the answer labelled version 2 would be version 1's."""
    relu, relu_out = files.branchy["relu"]
    sigmoid, sigmoid_out = files.branchy["sigmoid"]
    assert not np.allclose(relu_out, sigmoid_out)
    put(tmp_path, 1, relu)
    async with serving(tmp_path, Loader()) as s:
        old = s.executor(1)
        np.testing.assert_allclose((await s.infer())[1], relu_out, rtol=1e-5)  # type: ignore[index]
        put(tmp_path, 2, sigmoid)
        assert (await s.load()).status_code == 200
        assert list(s.control.loaded["a"]) == [2]
        assert s.executor(2) is not old, "version 2 was swapped into version 1's executor"
        label, out = await s.infer() or ("", X)
        assert label == "2"
        np.testing.assert_allclose(out, sigmoid_out, rtol=1e-5)
        await eventually(lambda: old.statistics().closed, "version 1 closed")


async def test_a_version_with_the_same_cond_program_and_other_weights_is_swapped(
    tmp_path: Path, files: Files
) -> None:
    """The structural comparison sees through the branches without rebuilding equal ones."""
    put(tmp_path, 1, files.branchy["relu"][0])
    async with serving(tmp_path, Loader()) as s:
        old = s.executor(1)
        other, other_out = files.branchy["relu_other"]
        put(tmp_path, 2, other)
        assert (await s.load()).status_code == 200
        assert s.executor(2) is old, "the same program with other weights was not swapped"
        label, out = await s.infer() or ("", X)
        assert label == "2"
        np.testing.assert_allclose(out, other_out, rtol=1e-5)


# -- swapping several versions -----------------------------------------------------------------


async def test_a_load_that_swaps_two_versions_labels_every_answer_with_its_weights(
    tmp_path: Path, files: Files, fold_gate: FoldGate
) -> None:
    """Versions 1 and 2 serve (latest:2); versions 3 and 4 arrive, each swapped into a leaving
    version's Executor. While the second swap's fold is held, concurrent requests to each
    version's URL and the unversioned one are answered with the output of the version they
    are labelled with (version 2's Executor does not already carry version 4's weights), and
    after the load, versions 3 and 4 answer with theirs."""
    outputs = {str(v + 1): out for v, (_, out) in enumerate(files.affine)}
    put(tmp_path, 1, files.affine[0][0])
    put(tmp_path, 2, files.affine[1][0])
    loader = Loader()
    async with serving(tmp_path, loader, policy="latest:2") as s:
        executors = {s.executor(1), s.executor(2)}
        assert all(e.statistics().folded_nodes for e in executors)  # a swap folds on a thread
        loader.after_load = lambda count: fold_gate.arm(2) if count == 4 else None
        put(tmp_path, 3, files.affine[2][0])
        put(tmp_path, 4, files.affine[3][0])
        load = asyncio.ensure_future(s.load())
        await fold_gate.wait_held()
        during = await asyncio.gather(*(s.infer(v) for v in ("", "1", "2") * 8))
        assert [a[0] for a in during if a is not None] == ["2", "1", "2"] * 8
        check_labels([a for a in during if a is not None], outputs)
        fold_gate.release.set()
        assert (await load).status_code == 200
        assert {s.executor(3), s.executor(4)} == executors  # both were swaps
        after = await asyncio.gather(*(s.infer(v) for v in ("", "3", "4", "1", "2") * 4))
        assert [a[0] if a else None for a in after] == ["4", "3", "4", None, None] * 4
        check_labels([a for a in after if a is not None], outputs)


async def test_a_load_failing_in_the_middle_of_its_swaps_leaves_the_old_versions(
    tmp_path: Path, files: Files, fold_gate: FoldGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second swap's fold fails and so does the rebuild model control falls back on: the
    load answers 500, versions 1 and 2 serve their own outputs, and the Executors the load
    made are closed. A second load, without the faults, swaps both."""
    outputs = {str(v + 1): out for v, (_, out) in enumerate(files.affine)}
    put(tmp_path, 1, files.affine[0][0])
    put(tmp_path, 2, files.affine[1][0])
    loader = Loader()
    async with serving(tmp_path, loader, policy="latest:2") as s:
        serving_before = {1: s.executor(1), 2: s.executor(2)}
        versions_before = {v: e.weights.version for v, e in serving_before.items()}

        async def no_rebuild(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected: the rebuild failed too")

        monkeypatch.setattr(ModelControl, "_own", no_rebuild)
        loader.after_load = lambda count: fold_gate.arm(2, fail=True) if count == 4 else None
        put(tmp_path, 3, files.affine[2][0])
        put(tmp_path, 4, files.affine[3][0])
        failed = await s.load()
        assert failed.status_code == 500, failed.text
        assert "injected" in failed.json()["error"]

        assert list(s.control.loaded["a"]) == [1, 2]
        assert {v: s.executor(v) for v in (1, 2)} == serving_before
        assert {v: e.weights.version for v, e in serving_before.items()} == versions_before
        answers = [await s.infer(v) for v in ("", "1", "2")]
        assert [a[0] for a in answers if a is not None] == ["2", "1", "2"]
        check_labels([a for a in answers if a is not None], outputs)
        made_by_load = [e for e in loader.made if e not in serving_before.values()]
        assert len(made_by_load) == 2
        assert all(e.statistics().closed for e in made_by_load), "the load left executors open"

        monkeypatch.undo()
        fold_gate.disarm()
        assert (await s.load()).status_code == 200
        assert list(s.control.loaded["a"]) == [3, 4]
        answers = [await s.infer(v) for v in ("", "3", "4")]
        assert [a[0] for a in answers if a is not None] == ["4", "3", "4"]
        check_labels([a for a in answers if a is not None], outputs)


async def test_a_load_cancelled_at_shutdown_in_the_middle_of_its_swaps_closes_its_executors(
    tmp_path: Path, files: Files, fold_gate: FoldGate
) -> None:
    """The app ends (model control's aclose cancels the loads running) while the second swap
    folds: every Executor the load made is closed with the rest."""
    put(tmp_path, 1, files.affine[0][0])
    put(tmp_path, 2, files.affine[1][0])
    loader = Loader()
    async with serving(tmp_path, loader, policy="latest:2") as s:
        loader.after_load = lambda count: fold_gate.arm(2) if count == 4 else None
        put(tmp_path, 3, files.affine[2][0])
        put(tmp_path, 4, files.affine[3][0])
        load = asyncio.ensure_future(s.control.load("a"))
        await fold_gate.wait_held()
        closing = asyncio.ensure_future(s.control.aclose())
        await asyncio.sleep(0)  # its first step cancels the load, which waits for its fold
        fold_gate.release.set()
        await asyncio.wait_for(closing, WAIT_S)
        with pytest.raises(asyncio.CancelledError):
            await load
        assert len(loader.made) == 4
        left_open = [e for e in loader.made if not e.statistics().closed]
        assert not left_open, f"{len(left_open)} executor(s) left open: {left_open}"


async def test_a_request_admitted_before_a_swap_and_run_after_it_is_labelled_by_its_weights(
    tmp_path: Path, files: Files
) -> None:
    """A request takes version 1 at its lookup and is held before it executes; version 2 is
    hot-swapped into the Executor meanwhile. It runs on version 2's weights, so it is
    labelled version 2: an answer's label is the version whose weights made it."""
    outputs = {str(v + 1): out for v, (_, out) in enumerate(files.affine)}
    v1 = put(tmp_path, 1, files.affine[0][0])
    loader = Loader()
    release = loader.hold(v1)
    async with serving(tmp_path, loader) as s:
        held = asyncio.ensure_future(s.infer("1"))
        await eventually(lambda: loader.held == 1, "a request of version 1 held")
        put(tmp_path, 2, files.affine[1][0])
        assert (await s.load()).status_code == 200
        release.set()
        answer = await held
        assert answer is not None and answer[0] == "2"
        check_labels([answer], outputs)


# -- what is a change --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rewritten", "replaced"])
async def test_a_file_replaced_with_the_same_size_and_time_is_reloaded(
    tmp_path: Path, files: Files, how: str
) -> None:
    """Version 1's file gets other weights of the same size, its modification time kept:
    `rewritten` in place (the same inode, `cp -p`), or `replaced` by a rename (a new inode,
    `rsync -a`). The load sees it and serves the new weights; a load after it does nothing."""
    (old, old_out), (new, new_out) = files.affine[0], files.affine[1]
    assert old.stat().st_size == new.stat().st_size
    target = put(tmp_path, 1, old)
    loader = Loader()
    async with serving(tmp_path, loader) as s:
        np.testing.assert_allclose((await s.infer())[1], old_out, rtol=1e-5)  # type: ignore[index]
        before = os.stat(target)
        staged = tmp_path / "staged.pt2"
        shutil.copyfile(new, staged)
        os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))
        if how == "rewritten":
            shutil.copy2(staged, target)  # copies the bytes into the file, then its times
        else:
            os.replace(staged, target)
        after = os.stat(target)
        assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)

        assert (await s.load()).status_code == 200
        label, out = await s.infer() or ("", X)
        assert label == "1"
        np.testing.assert_allclose(out, new_out, rtol=1e-5)
        loads = len(loader.made)
        assert (await s.load()).status_code == 200
        assert len(loader.made) == loads, "a load with nothing changed loaded again"


# -- the Executor's two halves of a swap -------------------------------------------------------


def _scaled(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ (w * 2).t() + b


async def test_prepared_weights_change_nothing_until_committed() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    new = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    async with Executor(export_model(model, x)) as ex:
        before = await ex.execute(x)
        prepared = await ex.prepare_weights(new, strict=True)
        assert ex.weights.version == 0
        torch.testing.assert_close(await ex.execute(x), before)
        assert ex.commit_weights(prepared) == 1
        torch.testing.assert_close(await ex.execute(x), _scaled(new["w"], new["b"], x))


async def test_a_commit_after_another_swap_folds_again() -> None:
    """A swap_weights between the preparation and the commit replaced a weight folding reads:
    the commit folds again, inline, and keeps both swaps."""
    model, x = Scaled(), torch.randn(5, 3)
    w, b = torch.randn(4, 3), torch.randn(4)
    async with Executor(export_model(model, x)) as ex:
        prepared = await ex.prepare_weights({"b": b})
        ex.swap_weights({"w": w})
        assert ex.commit_weights(prepared) == 2
        torch.testing.assert_close(await ex.execute(x), _scaled(w, b, x))


async def test_a_commit_is_refused_for_another_executor_or_a_closed_one() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    ep = export_model(model, x)
    new = {"w": torch.randn(4, 3)}
    async with Executor(ep) as one, Executor(ep) as other:
        prepared = await one.prepare_weights(new)
        with pytest.raises(ValueError, match="prepared by"):
            other.commit_weights(prepared)
        assert other.weights.version == 0
    with pytest.raises(ExecutorClosedError, match="closed"):
        one.commit_weights(prepared)
