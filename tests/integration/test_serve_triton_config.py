"""Triton's tools against asyncgraph: the model configuration extension (HTTP and gRPC
`ModelConfig`), server metadata's extensions, a repository model's config.pbtxt and the
metrics (its own port, Triton's series, per-version labels, every series typed).

Each test runs the app with its gRPC endpoint inside its own loop and talks to it with the
stock tritonclient clients (http.aio and grpc.aio), as perf_analyzer and Triton users do.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as tga
import tritonclient.http.aio as tha
from tritonclient.grpc import model_config_pb2 as tmc
from tritonclient.utils import InferenceServerException

import asyncgraph
from asyncgraph.runtime.config import BatchingConfig, ExecutorConfig
from asyncgraph.serve import create_app, running_server
from asyncgraph.serve.grpc_server import add_grpc
from asyncgraph.serve.model_control import add_model_control
from asyncgraph.serve.repository import ModelRepository, RepositoryError, VersionPolicy
from tests.support.models import Affine, export_model
from tests.support.serving import metric

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(120)]

WAIT_S = 20.0
X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8


@pytest.fixture(scope="module")
def pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Affine (Linear(4, 3)) exported with a dynamic batch, saved."""
    torch.manual_seed(0)
    ep = export_model(Affine(), torch.randn(2, 4), dynamic=True)
    path = tmp_path_factory.mktemp("pt2") / "affine.pt2"
    torch.export.save(ep, path)
    return path


class Clients:
    def __init__(self, http: tha.InferenceServerClient, grpc: tga.InferenceServerClient,
                 raw: httpx.AsyncClient, app: Any) -> None:
        self.http, self.grpc, self.raw, self.app = http, grpc, raw, app

    async def configs(self, model: str, version: str = "") -> tuple[dict[str, Any], Any]:
        """The model's configuration over HTTP (JSON) and gRPC (a ModelConfig message)."""
        over_http = await self.http.get_model_config(model, version)
        over_grpc = await self.grpc.get_model_config(model, version)
        return over_http, over_grpc.config


@asynccontextmanager
async def clients(app: Any) -> AsyncIterator[Clients]:
    endpoint = add_grpc(app, "127.0.0.1", 0, grace_s=5)
    async with running_server(app) as url, httpx.AsyncClient(base_url=url,
                                                             timeout=WAIT_S) as raw:
        http = tha.InferenceServerClient(url.removeprefix("http://"))
        grpc = tga.InferenceServerClient(endpoint.address)
        try:
            yield Clients(http, grpc, raw, app)
        finally:
            await http.close()
            await grpc.close()


@asynccontextmanager
async def repository(root: Path, *models: str) -> AsyncIterator[Clients]:
    app = create_app({}, calibrate=False)
    control = add_model_control(app, ModelRepository(root, VersionPolicy.parse("latest:1")),
                                load, explicit=True, calibrate=False)
    control.preload(models)
    async with clients(app) as c:
        yield c


def load(path: Path, **options: Any) -> asyncgraph.Executor:
    """The CLI's loader: asyncgraph.load with what a config.pbtxt sets."""
    return asyncgraph.load(path, ExecutorConfig(**options))


def put(root: Path, model: str, version: int, source: Path) -> None:
    target = root / model / str(version) / "model.pt2"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def grpc_json(message: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    as_json: dict[str, Any] = json_format.MessageToDict(
        message, preserving_proto_field_name=True)
    return as_json


# -- the model configuration ------------------------------------------------------------------


async def test_a_plain_models_config_over_http_and_grpc(pt2: Path) -> None:
    async with asyncgraph.Executor(asyncgraph.load(pt2).program) as ex, \
            clients(create_app({"lin": ex}, calibrate=False)) as c:
        http, grpc = await c.configs("lin")
        assert http["name"] == "lin" and http["platform"] == "pytorch_export"
        assert http["max_batch_size"] == 0 and "dynamic_batching" not in http
        assert http["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1, 4]}]
        assert http["output"] == [{"name": "output_0", "data_type": "TYPE_FP32",
                                   "dims": [-1, 3]}]
        assert http["version_policy"] == {"specific": {"versions": [1]}}
        assert http["instance_group"][0]["count"] == ex.config.max_concurrent_executions
        assert http["instance_group"][0]["kind"] == "KIND_CPU"
        assert grpc.max_batch_size == 0 and not grpc.HasField("dynamic_batching")
        assert [(i.name, tmc.DataType.Name(i.data_type), list(i.dims)) for i in grpc.input] \
            == [("x", "TYPE_FP32", [-1, 4])]
        assert list(grpc.version_policy.specific.versions) == [1]
        assert (await c.http.get_model_config("lin", "1"))["name"] == "lin"
        with pytest.raises(InferenceServerException, match="no version '2'"):
            await c.grpc.get_model_config("lin", "2")
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            await c.http.get_model_config("nope")


async def test_a_batching_models_config_says_so_without_the_batch_dim(pt2: Path) -> None:
    config = ExecutorConfig(batching=BatchingConfig(8, 0.0005))
    async with asyncgraph.load(pt2, config) as ex, \
            clients(create_app({"lin": ex}, calibrate=False)) as c:
        http, grpc = await c.configs("lin")
        assert http["max_batch_size"] == 8
        assert http["dynamic_batching"] == {"max_queue_delay_microseconds": 500}
        assert http["input"][0]["dims"] == [4] and http["output"][0]["dims"] == [3]
        assert grpc.max_batch_size == 8
        assert grpc.dynamic_batching.max_queue_delay_microseconds == 500
        assert list(grpc.input[0].dims) == [4]


def test_the_config_messages_are_tritons() -> None:
    """Every field of asyncgraph's ModelConfig subset has Triton's number and type."""
    from asyncgraph.serve.model_config import FILE

    def check(ours: Any, theirs: Any) -> None:
        for field in ours.fields:
            other = theirs.fields_by_name[field.name]
            assert (field.number, field.type) == (other.number, other.type), field.full_name
            if field.message_type is not None:
                check(field.message_type, other.message_type)
            if field.enum_type is not None:
                for value in field.enum_type.values:
                    assert other.enum_type.values_by_name[value.name].number == value.number

    from tritonclient.grpc import service_pb2 as tpb

    for name, message in FILE.message_types_by_name.items():
        theirs = (tmc.DESCRIPTOR.message_types_by_name.get(name)
                  or tpb.DESCRIPTOR.message_types_by_name[name])
        check(message, theirs)


# -- server metadata's extensions -------------------------------------------------------------


async def test_server_metadata_lists_exactly_the_extensions_served(pt2: Path) -> None:
    async with asyncgraph.Executor(asyncgraph.load(pt2).program) as ex, \
            clients(create_app({"lin": ex}, calibrate=False)) as c:
        over_http = (await c.http.get_server_metadata())["extensions"]
        over_grpc = list((await c.grpc.get_server_metadata()).extensions)
        assert sorted(over_http) == sorted(over_grpc)
        assert {"model_configuration", "model_repository", "binary_tensor_data"} <= set(
            over_http)
        x = tha.InferInput("x", [2, 4], "FP32")
        x.set_data_from_numpy(X, binary_data=True)
        probes: dict[str, list[Callable[[], Awaitable[Any]]]] = {
            # an extension listed must answer on both transports
            "binary_tensor_data": [lambda: c.http.infer("lin", [x])],
            "model_configuration": [lambda: c.http.get_model_config("lin"),
                                    lambda: c.grpc.get_model_config("lin")],
            "model_repository": [lambda: c.http.get_model_repository_index(),
                                 lambda: c.grpc.get_model_repository_index()],
            "statistics": [lambda: c.http.get_inference_statistics("lin"),
                           lambda: c.grpc.get_inference_statistics("lin")],
            "system_shared_memory": [lambda: c.http.get_system_shared_memory_status(),
                                     lambda: c.grpc.get_system_shared_memory_status()],
        }
        for extension in over_http:
            assert extension in probes, f"{extension} is listed but not known to this test"
            for probe in probes[extension]:
                await probe()


# -- config.pbtxt -------------------------------------------------------------------------------


CONFIG = """
name: "a"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 200 }
version_policy: { latest { num_versions: 2 } }
instance_group [ { count: 3 kind: KIND_CPU } ]
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""


async def test_a_config_pbtxt_applies(tmp_path: Path, pt2: Path) -> None:
    for version in (1, 2, 3):
        put(tmp_path, "a", version, pt2)
    (tmp_path / "a" / "config.pbtxt").write_text(CONFIG)
    async with repository(tmp_path, "a") as c:
        assert (await c.raw.post("/v2/repository/index")).json()[0]["version"] == "2"
        http, grpc = await c.configs("a")
        assert http["version_policy"] == {"latest": {"num_versions": 2}}
        assert http["max_batch_size"] == 8
        assert http["dynamic_batching"] == {"max_queue_delay_microseconds": 200}
        assert http["instance_group"][0]["count"] == 3
        assert http["input"] == [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [4]}]
        assert http["output"] == [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [3]}]
        assert grpc_json(grpc)["input"][0]["name"] == "INPUT__0"
        assert list(grpc.version_policy.latest.__class__.DESCRIPTOR.fields_by_name) == [
            "num_versions"] and grpc.version_policy.latest.num_versions == 2
        body = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [2, 4],
                            "data": X.reshape(-1).tolist()}]}
        answer = await c.raw.post("/v2/models/a/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["name"] == "OUTPUT__0"
        metadata = await c.grpc.get_model_metadata("a", "2")
        assert [i.name for i in metadata.inputs] == ["INPUT__0"]


@pytest.mark.parametrize(("text", "field"), [
    ("sequence_batching { }", "sequence_batching"),
    ("max_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 2 ] }",
     "dynamic_batching.preferred_batch_size"),
    ("dynamic_batching { }", "dynamic_batching"),
    ('platform: "onnxruntime_onnx"', "platform"),
    ('input [ { name: "x" data_type: TYPE_INT64 dims: [ -1, 4 ] } ]', "input[0].data_type"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 4 ] } ]', "input[0].dims"),
    ('instance_group [ { count: 1 kind: KIND_GPU } ]', "instance_group[0].kind"),
])
async def test_a_config_pbtxt_field_that_cannot_apply_is_refused_by_name(
    tmp_path: Path, pt2: Path, text: str, field: str
) -> None:
    put(tmp_path, "a", 1, pt2)
    config = tmp_path / "a" / "config.pbtxt"
    config.write_text(text)
    with pytest.raises(RepositoryError) as refused:
        async with repository(tmp_path, "a"):
            pass
    assert str(config) in str(refused.value) and repr(field) in str(refused.value)
    # and a load request over HTTP says the same (400), the model left unloaded
    async with repository(tmp_path) as c:
        answer = await c.raw.post("/v2/repository/models/a/load")
        assert answer.status_code == 400 and repr(field) in answer.json()["error"]


# -- metrics ------------------------------------------------------------------------------------


async def test_metrics_port_series_per_version_and_types(tmp_path: Path, pt2: Path) -> None:
    from asyncgraph.serve.metrics_port import add_metrics_port

    for version in (1, 2):
        put(tmp_path, "a", version, pt2)
    (tmp_path / "a" / "config.pbtxt").write_text(
        "version_policy: { specific { versions: [ 1, 2 ] } }")
    app = create_app({}, calibrate=False)
    control = add_model_control(app, ModelRepository(tmp_path), load, explicit=True,
                                calibrate=False)
    control.preload(["a"])
    port = add_metrics_port(app, "127.0.0.1", 0)
    async with clients(app) as c:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                            "data": X.reshape(-1).tolist()}]}
        for version, count in (("1", 2), ("2", 1)):
            for _ in range(count):
                answer = await c.raw.post(f"/v2/models/a/versions/{version}/infer", json=body)
                assert answer.status_code == 200, answer.text
        async with httpx.AsyncClient(base_url=port.url, timeout=WAIT_S) as metrics_client:
            text = (await metrics_client.get("/metrics")).text
        assert text == (await c.raw.get("/metrics")).text or "nv_inference" in text
        for version, count in (("1", 2), ("2", 1)):
            labels = {"model": "a", "version": version}
            assert metric(text, "nv_inference_request_success", **labels) == count
            assert metric(text, "nv_inference_count", **labels) == count
            for series in ("compute_input", "compute_infer", "compute_output"):
                assert metric(text, f"nv_inference_{series}_duration_us", **labels) > 0
        assert "# TYPE nv_inference_request_success counter" in text
        untyped = [line for line in text.splitlines()
                   if line.startswith("# TYPE") and line.endswith(("untyped", "unknown"))]
        assert untyped == []


def test_the_command_serves_metrics_on_their_port_and_applies_a_config_pbtxt(
    tmp_path: Path, pt2: Path
) -> None:
    import socket

    from tests.support.serving import serve as cli_serve

    put(tmp_path, "a", 1, pt2)
    (tmp_path / "a" / "config.pbtxt").write_text(
        'max_batch_size: 4\ndynamic_batching { }\n'
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]')
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with cli_serve("--model-repository", str(tmp_path), "--port", "0",
                   "--metrics-port", str(free)) as served:
        url = served.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            config = http.get("/v2/models/a/config").json()
            assert config["max_batch_size"] == 4 and config["input"][0]["name"] == "INPUT__0"
        text = httpx.get(f"http://127.0.0.1:{free}/metrics", timeout=WAIT_S).text
        assert metric(text, "nv_inference_request_success", model="a", version="1") == 0
