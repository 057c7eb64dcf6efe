"""Model control (Triton's model repository extension) over HTTP and gRPC: index, load, unload,
hot reloads with requests in flight, version policies and a repository's errors.

Each test lays out a repository in a temporary folder from .pt2 files exported once per module
(`Affine` with two sets of weights: a weights-only new version; a Linear(4, 5): a changed
signature), runs the app with its gRPC endpoint inside its own loop and talks to it with httpx
and tritonclient.grpc.aio. A loader wraps each Executor's `execute_flat` so that a test can
hold the requests of one file's Executor in flight.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as tga
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException
from typer.testing import CliRunner

import asyncgraph
from asyncgraph.cli.main import app as cli_app
from asyncgraph.serve import create_app, running_server
from asyncgraph.serve.core import NOT_ALLOWED
from asyncgraph.serve.grpc_server import add_grpc
from asyncgraph.serve.model_control import ModelControl, add_model_control
from asyncgraph.serve.repository import ModelRepository, RepositoryError, VersionPolicy
from tests.support.models import Affine
from tests.support.serving import eventually, metric
from tests.support.serving import serve as cli_serve

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(120)]

WAIT_S = 20.0
X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8


def _export(model: torch.nn.Module, path: Path) -> np.ndarray:
    """Save `model` exported with a dynamic batch; return its output for X."""
    model.eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, path)
    with torch.no_grad():
        out: np.ndarray = model(torch.from_numpy(X)).numpy()
    return out


class Files:
    """The module's .pt2 files and their outputs for X."""

    def __init__(self, root: Path) -> None:
        torch.manual_seed(0)
        self.a0, self.a0_out = root / "a0.pt2", _export(Affine(), root / "a0.pt2")
        torch.manual_seed(1)
        self.a1, self.a1_out = root / "a1.pt2", _export(Affine(), root / "a1.pt2")

        class Wide(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(4, 5)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(self.linear(x))

        torch.manual_seed(2)
        self.wide, self.wide_out = root / "wide.pt2", _export(Wide(), root / "wide.pt2")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("pt2"))


def put(repo: Path, model: str, version: int, source: Path, *, folder: bool = True) -> Path:
    """Copy `source` into the repository as `model`'s `version` (Triton's folder layout, or
    DIR/model/version.pt2)."""
    name = f"{version}/model.pt2" if folder else f"{version}.pt2"
    target = repo / model / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


class Loader:
    """asyncgraph.load, with the requests of a held file's Executors held before they run."""

    def __init__(self) -> None:
        self.holds: dict[Path, asyncio.Event] = {}
        self.held = 0
        self.loads = 0

    def hold(self, path: Path) -> asyncio.Event:
        event = self.holds[path] = asyncio.Event()
        return event

    def __call__(self, path: Path) -> asyncgraph.Executor:
        self.loads += 1
        ex = asyncgraph.load(path)
        real = ex.execute_flat
        hold = self.holds.get(path)

        async def execute_flat(inputs: Any) -> list[Any]:
            if hold is not None:
                self.held += 1
                await hold.wait()
            return await real(inputs)

        ex.execute_flat = execute_flat  # type: ignore[method-assign]
        return ex


class Served:
    def __init__(self, control: ModelControl, http: httpx.AsyncClient,
                 client: tga.InferenceServerClient, loader: Loader) -> None:
        self.control, self.http, self.client, self.loader = control, http, client, loader

    async def infer(self, model: str, version: str = "") -> httpx.Response:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
        return await self.http.post(path, json={"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": X.reshape(-1).tolist()}
        ]})

    async def grpc_infer(self, model: str, version: str = "") -> Any:
        x = InferInput("x", [2, 4], "FP32")
        x.set_data_from_numpy(X)
        return await self.client.infer(model, [x], model_version=version)

    async def index(self, **body: Any) -> list[dict[str, str]]:
        response = await self.http.post("/v2/repository/index", json=body)
        assert response.status_code == 200, response.text
        entries: list[dict[str, str]] = response.json()
        return entries


@asynccontextmanager
async def serving(
    repo: Path, *, explicit: bool = True, preload: list[str] | None = None,
    policy: str = "latest:1", loader: Loader | None = None, calibrate: bool = False,
) -> AsyncIterator[Served]:
    loader = loader or Loader()
    app = create_app({}, calibrate=calibrate)
    control = add_model_control(app, ModelRepository(repo, VersionPolicy.parse(policy)), loader,
                                explicit=explicit, calibrate=calibrate)
    control.preload(preload if preload is not None else
                    ([] if explicit else control.repository.models()))
    endpoint = add_grpc(app, "127.0.0.1", 0, grace_s=5)
    async with (
        running_server(app) as url,
        httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http,
    ):
        client = tga.InferenceServerClient(endpoint.address)
        try:
            yield Served(control, http, client, loader)
        finally:
            await client.close()


def output(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status())


# -- modes and the endpoints -------------------------------------------------------------------


async def test_none_mode_loads_every_model_and_refuses_load_and_unload(
    tmp_path: Path, files: Files
) -> None:
    put(tmp_path, "a", 1, files.a0)
    put(tmp_path, "w", 1, files.wide, folder=False)
    async with serving(tmp_path, explicit=False) as s:
        assert await s.index() == [
            {"name": "a", "version": "1", "state": "READY", "reason": ""},
            {"name": "w", "version": "1", "state": "READY", "reason": ""},
        ]
        np.testing.assert_allclose(output(await s.infer("a")), files.a0_out, rtol=1e-5)
        np.testing.assert_allclose(output(await s.infer("w")), files.wide_out, rtol=1e-5)
        meta = (await s.http.get("/v2")).json()
        assert "model_repository" in meta["extensions"]
        for action in ("load", "unload"):
            response = await s.http.post(f"/v2/repository/models/a/{action}")
            assert response.status_code == 503
            assert response.json() == {"error": NOT_ALLOWED}
        with pytest.raises(InferenceServerException) as refused:
            await s.client.load_model("a")
        assert code_of(refused.value) == "StatusCode.UNAVAILABLE"
        assert NOT_ALLOWED in str(refused.value)
        assert len((await s.client.get_model_repository_index()).models) == 2


async def test_without_a_repository_the_index_lists_the_models_and_load_is_refused(
    files: Files,
) -> None:
    async with asyncgraph.load(files.a0) as ex:
        app = create_app({"a": ex}, calibrate=False)
        async with running_server(app) as url, httpx.AsyncClient(base_url=url) as http:
            index = await http.post("/v2/repository/index")
            assert index.json() == [{"name": "a", "version": "1", "state": "READY",
                                     "reason": ""}]
            load = await http.post("/v2/repository/models/a/load", json={})
            assert (load.status_code, load.json()) == (503, {"error": NOT_ALLOWED})
            assert load.headers["retry-after"] == "1"
            # served without a repository too: the index answers, load and unload say 503
            assert "model_repository" in (await http.get("/v2")).json()["extensions"]


async def test_explicit_load_infer_and_unload_over_http_and_grpc(
    tmp_path: Path, files: Files
) -> None:
    put(tmp_path, "a", 1, files.a0)
    put(tmp_path, "w", 1, files.wide)
    async with serving(tmp_path) as s:
        assert s.loader.loads == 0  # explicit: nothing loaded at start
        assert await s.index() == [
            {"name": "a", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"},
            {"name": "w", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"},
        ]
        assert await s.index(ready=True) == []
        missing = await s.infer("a")
        assert missing.status_code == 404 and "not ready" in missing.json()["error"]
        not_ready = await s.http.get("/v2/models/a/ready")
        assert (not_ready.status_code, not_ready.json()) == (503, {"name": "a", "ready": False})
        assert not await s.client.is_model_ready("a")

        assert (await s.http.post("/v2/repository/models/a/load")).status_code == 200
        np.testing.assert_allclose(output(await s.infer("a")), files.a0_out, rtol=1e-5)
        assert (await s.infer("a")).json()["model_version"] == "1"
        assert (await s.http.get("/v2/models/a")).json()["versions"] == ["1"]
        assert (await s.http.get("/v2/models/a/ready")).status_code == 200

        await s.client.load_model("w")  # gRPC's RepositoryModelLoad
        assert await s.client.is_model_ready("w")
        result = await s.grpc_infer("w")
        np.testing.assert_allclose(result.as_numpy("output_0"), files.wide_out, rtol=1e-5)
        index = await s.client.get_model_repository_index()
        assert [(m.name, m.version, m.state) for m in index.models] == [
            ("a", "1", "READY"), ("w", "1", "READY")
        ]
        metrics = (await s.http.get("/metrics")).text
        assert metric(metrics, "asyncgraph_model_state", model="w", version="1",
                      state="READY") == 1
        assert metric(metrics, "asyncgraph_model_changes_total", model="w", kind="load") == 1

        await s.client.unload_model("w")
        with pytest.raises(InferenceServerException) as gone:
            await s.grpc_infer("w")
        assert code_of(gone.value) == "StatusCode.NOT_FOUND"
        assert not await s.client.is_model_ready("w")
        assert (await s.http.post("/v2/repository/models/a/unload", json={
            "parameters": {"unload_dependents": False}})).status_code == 200
        assert (await s.infer("a")).status_code == 404
        assert await s.index() == [
            {"name": "a", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"},
            {"name": "w", "version": "", "state": "UNAVAILABLE", "reason": "unloaded"},
        ]
        metrics = (await s.http.get("/metrics")).text
        assert metric(metrics, "asyncgraph_model_state", model="w", version="",
                      state="UNAVAILABLE") == 1
        assert 'model="w",version="1"' not in metrics.split("asyncgraph_model_state")[-1]
        assert metric(metrics, "asyncgraph_model_changes_total", model="w", kind="unload") == 1
        # loaded again after an unload
        await s.client.load_model("w")
        assert await s.client.is_model_ready("w")


# -- hot reloads -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["swap", "rebuild"])
async def test_no_request_fails_during_a_reload_under_traffic(
    tmp_path: Path, files: Files, kind: str
) -> None:
    """Clients keep requests in flight over HTTP and gRPC while version 2 is loaded in place
    of version 1: every request is answered 200 with one version's result."""
    put(tmp_path, "a", 1, files.a0)
    new, new_out = (files.a1, files.a1_out) if kind == "swap" else (files.wide, files.wide_out)
    async with serving(tmp_path, preload=["a"], calibrate=True) as s:
        old_executor = s.control.loaded["a"][1].served.executor
        stop = asyncio.Event()
        answers: list[np.ndarray] = []

        async def http_client() -> None:
            while not stop.is_set():
                answers.append(output(await s.infer("a")))

        async def grpc_client() -> None:
            while not stop.is_set():
                answers.append((await s.grpc_infer("a")).as_numpy("output_0"))

        clients = [asyncio.ensure_future(c()) for c in [http_client] * 4 + [grpc_client] * 4]
        await eventually(lambda: len(answers) >= 16, "traffic before the load")
        put(tmp_path, "a", 2, new)
        before = len(answers)
        assert (await s.http.post("/v2/repository/models/a/load")).status_code == 200
        await eventually(lambda: len(answers) >= before + 32, "traffic after the load")
        stop.set()
        await asyncio.gather(*clients)  # any failure (non-200, gRPC error) raises here

        for answer in answers:
            matches_old = answer.shape == files.a0_out.shape and np.allclose(
                answer, files.a0_out, rtol=1e-5)
            matches_new = answer.shape == new_out.shape and np.allclose(
                answer, new_out, rtol=1e-5)
            assert matches_old or matches_new, answer
        np.testing.assert_allclose(output(await s.infer("a")), new_out, rtol=1e-5)
        assert (await s.infer("a")).json()["model_version"] == "2"
        assert list(s.control.loaded["a"]) == [2]
        executor = s.control.loaded["a"][2].served.executor
        if kind == "swap":  # weights only: the same Executor, its weights swapped
            assert executor is old_executor
            assert s.loader.loads == 2  # the new file was read (and its Executor dropped)
        else:
            assert executor is not old_executor
            await eventually(lambda: old_executor.statistics().closed,
                             "the old executor closed after its last request")
        metrics = (await s.http.get("/metrics")).text
        assert metric(metrics, "asyncgraph_model_changes_total", model="a", kind=kind if
                      kind == "swap" else "load") >= 1


async def test_a_rebuild_lets_the_old_versions_requests_finish_on_it(
    tmp_path: Path, files: Files
) -> None:
    """Requests held inside version 1 while version 2 (another signature) is built beside it:
    new requests go to version 2 at once; the held ones finish 200 on version 1, whose
    Executor is closed only after them."""
    v1 = put(tmp_path, "a", 1, files.a0)
    loader = Loader()
    release = loader.hold(v1)
    async with serving(tmp_path, preload=["a"], loader=loader) as s:
        old_executor = s.control.loaded["a"][1].served.executor
        held = [asyncio.ensure_future(s.infer("a")) for _ in range(3)]
        held.append(asyncio.ensure_future(s.grpc_infer("a")))
        await eventually(lambda: loader.held == 4, "four requests held in version 1")
        put(tmp_path, "a", 2, files.wide)
        assert (await s.http.post("/v2/repository/models/a/load")).status_code == 200
        new = await s.infer("a")
        np.testing.assert_allclose(output(new), files.wide_out, rtol=1e-5)
        assert new.json()["model_version"] == "2"
        assert not old_executor.statistics().closed  # its requests are still in it
        assert not any(t.done() for t in held)
        release.set()
        answers = await asyncio.gather(*held)
        for answer in answers[:3]:
            np.testing.assert_allclose(output(answer), files.a0_out, rtol=1e-5)
            assert answer.json()["model_version"] == "1"
        np.testing.assert_allclose(answers[3].as_numpy("output_0"), files.a0_out, rtol=1e-5)
        await eventually(lambda: old_executor.statistics().closed, "version 1 closed")


async def test_a_weights_swap_keeps_the_held_requests_and_serves_the_new_weights(
    tmp_path: Path, files: Files
) -> None:
    v1 = put(tmp_path, "a", 1, files.a0)
    loader = Loader()
    release = loader.hold(v1)
    async with serving(tmp_path, preload=["a"], loader=loader) as s:
        held = [asyncio.ensure_future(s.infer("a")) for _ in range(3)]
        await eventually(lambda: loader.held == 3, "three requests held")
        put(tmp_path, "a", 2, files.a1)
        assert (await s.http.post("/v2/repository/models/a/load")).status_code == 200
        assert list(s.control.loaded["a"]) == [2]
        release.set()
        for answer in await asyncio.gather(*held):
            out = output(answer)
            assert np.allclose(out, files.a0_out, rtol=1e-5) or np.allclose(
                out, files.a1_out, rtol=1e-5)
        np.testing.assert_allclose(output(await s.infer("a")), files.a1_out, rtol=1e-5)
        # a load with nothing changed on disk is a no-op; a rewritten file is a reload
        loads = loader.loads
        assert (await s.http.post("/v2/repository/models/a/load")).status_code == 200
        assert loader.loads == loads
        put(tmp_path, "a", 2, files.a0)
        assert (await s.http.post("/v2/repository/models/a/load")).status_code == 200
        assert loader.loads == loads + 1
        np.testing.assert_allclose(output(await s.infer("a")), files.a0_out, rtol=1e-5)


async def test_unload_finishes_the_requests_in_flight_and_refuses_new_ones(
    tmp_path: Path, files: Files
) -> None:
    v1 = put(tmp_path, "a", 1, files.a0)
    loader = Loader()
    release = loader.hold(v1)
    async with serving(tmp_path, preload=["a"], loader=loader) as s:
        executor = s.control.loaded["a"][1].served.executor
        held = [asyncio.ensure_future(s.infer("a")) for _ in range(2)]
        held.append(asyncio.ensure_future(s.grpc_infer("a")))
        await eventually(lambda: loader.held == 3, "three requests held")
        unload = asyncio.ensure_future(s.client.unload_model("a"))
        await eventually(lambda: "a" not in s.control.loaded, "out of routing")
        refused = await s.infer("a")
        assert refused.status_code == 404, refused.text
        with pytest.raises(InferenceServerException) as gone:
            await s.grpc_infer("a")
        assert code_of(gone.value) == "StatusCode.NOT_FOUND"
        assert [e["state"] for e in await s.index()] == ["UNLOADING"]
        assert not unload.done() and not executor.statistics().closed
        release.set()
        answers = await asyncio.gather(*held)
        for answer in answers[:2]:
            np.testing.assert_allclose(output(answer), files.a0_out, rtol=1e-5)
        np.testing.assert_allclose(answers[2].as_numpy("output_0"), files.a0_out, rtol=1e-5)
        await asyncio.wait_for(unload, WAIT_S)
        assert executor.statistics().closed
        assert [e["state"] for e in await s.index()] == ["UNAVAILABLE"]


class SlowLoader(Loader):
    """A Loader whose loads wait (on their thread) until `go` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.waiting = 0

    def __call__(self, path: Path) -> asyncgraph.Executor:
        self.waiting += 1
        assert self.go.wait(WAIT_S), "the test never let the load go on"
        return super().__call__(path)


async def test_a_first_load_is_loading_and_concurrent_loads_run_one_at_a_time(
    tmp_path: Path, files: Files
) -> None:
    put(tmp_path, "a", 1, files.a0)
    loader = SlowLoader()
    async with serving(tmp_path, loader=loader) as s:
        first = asyncio.ensure_future(s.http.post("/v2/repository/models/a/load"))
        second = asyncio.ensure_future(s.client.load_model("a"))
        await eventually(lambda: loader.waiting == 1, "the first load on its thread")
        assert await s.index() == [{"name": "a", "version": "", "state": "LOADING",
                                    "reason": ""}]
        loading = await s.infer("a")
        assert loading.status_code == 404 and "not ready: loading" in loading.json()["error"]
        assert (await s.http.get("/v2/health/live")).status_code == 200  # the loop serves
        loader.go.set()
        assert (await first).status_code == 200
        await second  # the same files: nothing more to load
        assert loader.loads == 1
        np.testing.assert_allclose(output(await s.infer("a")), files.a0_out, rtol=1e-5)


async def test_an_unload_whose_caller_goes_away_still_finishes(
    tmp_path: Path, files: Files
) -> None:
    v1 = put(tmp_path, "a", 1, files.a0)
    loader = Loader()
    release = loader.hold(v1)
    async with serving(tmp_path, preload=["a"], loader=loader) as s:
        executor = s.control.loaded["a"][1].served.executor
        held = asyncio.ensure_future(s.infer("a"))
        await eventually(lambda: loader.held == 1, "a request held")
        with pytest.raises(InferenceServerException) as timed_out:
            await s.client.unload_model("a", client_timeout=0.2)
        assert code_of(timed_out.value) == "StatusCode.DEADLINE_EXCEEDED"
        assert [e["state"] for e in await s.index()] == ["UNLOADING"]
        release.set()
        np.testing.assert_allclose(output(await held), files.a0_out, rtol=1e-5)
        await eventually(lambda: executor.statistics().closed, "closed after its request")
        await eventually(lambda: s.control.state.get("a") == ("UNAVAILABLE", "unloaded"),
                         "unloaded")


# -- version policies --------------------------------------------------------------------------


async def test_latest_two_serves_two_versions_under_their_urls(
    tmp_path: Path, files: Files
) -> None:
    put(tmp_path, "a", 1, files.wide)
    put(tmp_path, "a", 2, files.a0, folder=False)
    put(tmp_path, "a", 3, files.a1)
    async with serving(tmp_path, preload=["a"], policy="latest:2") as s:
        assert (await s.http.get("/v2/models/a")).json()["versions"] == ["2", "3"]
        np.testing.assert_allclose(output(await s.infer("a", "2")), files.a0_out, rtol=1e-5)
        np.testing.assert_allclose(output(await s.infer("a", "3")), files.a1_out, rtol=1e-5)
        np.testing.assert_allclose(output(await s.infer("a")), files.a1_out, rtol=1e-5)
        result = await s.grpc_infer("a", "2")
        np.testing.assert_allclose(result.as_numpy("output_0"), files.a0_out, rtol=1e-5)
        old = await s.infer("a", "1")
        assert old.status_code == 404 and "versions: 2, 3" in old.json()["error"]
        assert (await s.http.get("/v2/models/a/versions/3/ready")).status_code == 200
        assert (await s.http.get("/v2/models/a/versions/1/ready")).status_code == 404
        assert [e["version"] for e in await s.index()] == ["2", "3"]
        metadata = await s.client.get_model_metadata("a")
        assert list(metadata.versions) == ["2", "3"]
        assert (await s.grpc_infer("a")).get_response().model_version == "3"


async def test_a_models_config_sets_specific_versions(tmp_path: Path, files: Files) -> None:
    put(tmp_path, "a", 1, files.a0)
    put(tmp_path, "a", 2, files.wide)
    put(tmp_path, "a", 3, files.a1)
    (tmp_path / "a" / "config.json").write_text('{"version_policy": "specific:1,3"}')
    async with serving(tmp_path, preload=["a"]) as s:
        assert list(s.control.loaded["a"]) == [1, 3]
        np.testing.assert_allclose(output(await s.infer("a", "1")), files.a0_out, rtol=1e-5)
        assert (await s.infer("a", "2")).status_code == 404
        # the policy changes on disk: a load applies it (version 1 leaves, 2 arrives)
        (tmp_path / "a" / "config.json").write_text('{"version_policy": "latest:2"}')
        assert (await s.http.post("/v2/repository/models/a/load")).status_code == 200
        assert list(s.control.loaded["a"]) == [2, 3]
        np.testing.assert_allclose(output(await s.infer("a", "2")), files.wide_out, rtol=1e-5)


def test_version_policies_parse_and_select() -> None:
    assert VersionPolicy.parse("latest:2").select([1, 5, 3]) == [3, 5]
    assert VersionPolicy.parse("latest").select([1, 2]) == [2]
    assert VersionPolicy.parse("all").select([2, 1]) == [1, 2]
    assert VersionPolicy.parse("specific:3,1").select([1, 2, 3]) == [1, 3]
    with pytest.raises(RepositoryError, match=r"version\(s\) 4 not in the repository"):
        VersionPolicy.parse("specific:4").select([1])
    for bad in ("latest:0", "newest", "specific:", "specific:a", "all:2"):
        with pytest.raises(ValueError, match="expected latest:N"):
            VersionPolicy.parse(bad)


# -- errors ------------------------------------------------------------------------------------


async def test_errors_name_the_model_and_the_path_at_fault(tmp_path: Path, files: Files) -> None:
    put(tmp_path, "a", 1, files.a0)
    (tmp_path / "empty_version" / "1").mkdir(parents=True)
    (tmp_path / "twice").mkdir()
    put(tmp_path, "twice", 1, files.a0)
    put(tmp_path, "twice", 1, files.a0, folder=False)
    (tmp_path / "unnumbered").mkdir()
    shutil.copyfile(files.a0, tmp_path / "unnumbered" / "latest.pt2")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.pt2").write_bytes(b"not a zip")
    async with serving(tmp_path, preload=["a"]) as s:
        expected = {
            "empty_version": f"version folder {tmp_path}/empty_version/1 has no model.pt2",
            "twice": "version 1 is given twice",
            "unnumbered": f"{tmp_path}/unnumbered/latest.pt2 is not a version",
            "nothing": f"{tmp_path}/nothing holds no version",
            "broken": f"failed to load 'broken' version 1 from {tmp_path}/broken/1/model.pt2",
        }
        for name, message in expected.items():
            response = await s.http.post(f"/v2/repository/models/{name}/load")
            assert response.status_code == 400, response.text
            assert message in response.json()["error"], response.json()
        with pytest.raises(InferenceServerException) as bad:
            await s.client.load_model("twice")
        assert code_of(bad.value) == "StatusCode.INVALID_ARGUMENT"
        index = {e["name"]: e for e in await s.index()}
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert "broken/1/model.pt2" in index["broken"]["reason"]
        assert index["a"]["state"] == "READY"

        unknown = await s.http.post("/v2/repository/models/nope/load")
        assert unknown.status_code == 404 and "'nope'" in unknown.json()["error"]
        with pytest.raises(InferenceServerException) as missing:
            await s.client.unload_model("nope")
        assert code_of(missing.value) == "StatusCode.NOT_FOUND"
        assert (await s.infer("nope")).status_code == 404
        bad_body = await s.http.post("/v2/repository/models/a/load",
                                     json={"parameters": {"config": "{}"}})
        assert bad_body.status_code == 400 and "'config'" in bad_body.json()["error"]
        assert (await s.http.post("/v2/repository/index", json={"ready": "yes"})).status_code \
            == 400

        # a failed reload leaves the version serving as it was
        put(tmp_path, "a", 2, tmp_path / "broken" / "1" / "model.pt2")
        failed = await s.http.post("/v2/repository/models/a/load")
        assert failed.status_code == 400 and "version 2" in failed.json()["error"]
        np.testing.assert_allclose(output(await s.infer("a")), files.a0_out, rtol=1e-5)
        assert list(s.control.loaded["a"]) == [1]


def test_a_repository_that_is_not_a_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match=f"model repository {tmp_path}/nope: not a folder"):
        ModelRepository(tmp_path / "nope")


async def test_grpc_repository_calls_without_a_repository_are_unavailable(files: Files) -> None:
    async with asyncgraph.load(files.a0) as ex:
        app = create_app({"a": ex}, calibrate=False)
        endpoint = add_grpc(app, "127.0.0.1", 0, grace_s=5)
        async with running_server(app), grpc.aio.insecure_channel(endpoint.address):
            client = tga.InferenceServerClient(endpoint.address)
            try:
                index = await client.get_model_repository_index()
                assert [(m.name, m.state) for m in index.models] == [("a", "READY")]
                with pytest.raises(InferenceServerException) as refused:
                    await client.unload_model("a")
                assert code_of(refused.value) == "StatusCode.UNAVAILABLE"
            finally:
                await client.close()


# -- the command ---------------------------------------------------------------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`asyncgraph serve ARGS` in this process (typer's runner), for the errors it gives
    before serving: a subprocess per case cost ~5 s of importing torch each."""
    result = CliRunner().invoke(cli_app, ["serve", *args])
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def test_the_command_serves_a_repository_with_explicit_model_control(
    tmp_path: Path, files: Files
) -> None:
    put(tmp_path, "a", 1, files.a0)
    put(tmp_path, "w", 1, files.wide, folder=False)
    with cli_serve("--model-repository", str(tmp_path), "--model-control", "explicit",
                   "--load-model", "a", "--port", "0") as served:
        url = served.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
        banner = " ".join(served.output().split())  # the table's title may wrap
        assert "model control explicit, default version policy latest:1" in banner, banner
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            index = http.post("/v2/repository/index").json()
            assert [(e["name"], e["state"]) for e in index] == [
                ("a", "READY"), ("w", "UNAVAILABLE")
            ]
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                                "data": X.reshape(-1).tolist()}]}
            assert http.post("/v2/models/w/infer", json=body).status_code == 404
            assert http.post("/v2/repository/models/w/load").status_code == 200
            out = http.post("/v2/models/w/infer", json=body).json()["outputs"][0]
            np.testing.assert_allclose(np.asarray(out["data"]).reshape(out["shape"]),
                                       files.wide_out, rtol=1e-5)
            put(tmp_path, "a", 2, files.a1)  # a weights-only version: a hot swap
            assert http.post("/v2/repository/models/a/load").status_code == 200
            answer = http.post("/v2/models/a/infer", json=body).json()
            assert answer["model_version"] == "2"
            metrics = http.get("/metrics").text
            assert metric(metrics, "nv_inference_request_success", model="a", version="2") == 1
            assert http.post("/v2/repository/models/a/unload").status_code == 200
            assert http.get("/v2/models/a/ready").status_code == 503
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=WAIT_S) == 0, served.output()
    assert "Traceback" not in served.output(), served.output()


def test_the_command_names_a_bad_repository_in_one_line_before_serving(
    tmp_path: Path, files: Files
) -> None:
    put(tmp_path, "a", 1, files.a0)
    (tmp_path / "b" / "3").mkdir(parents=True)  # none mode loads every model: b fails
    done = _run_cli("--model-repository", str(tmp_path), "--port", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [f"error: model 'b': version folder {tmp_path}/b/3 has no model.pt2 "
                      f"(expected {tmp_path}/b/3/model.pt2)"], done.stderr
    assert "Uvicorn running" not in done.stdout + done.stderr
    for args, message in [
        (["--load-model", "a"], "--load-model needs --model-control explicit"),
        (["--model-control", "explicit", "--version-policy", "newest"],
         "version policy 'newest': expected"),
        (["--model-control", "explicit", "--load-model", "zz"], "model 'zz': no folder"),
    ]:
        done = _run_cli("--model-repository", str(tmp_path), "--port", "0", *args)
        assert done.returncode == 1 and message in done.stderr, done.stdout + done.stderr
    done = _run_cli(str(files.a0), "--model-control", "explicit")
    assert done.returncode == 1 and "need --model-repository" in done.stderr, done.stderr
