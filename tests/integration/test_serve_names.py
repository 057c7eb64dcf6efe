"""Hostile model names and versions, and the bounds on what a gRPC answer may cost.

A version such as `²` (a digit to `str.isdigit`, not to `int`) or 5,000 digits, a model name
longer than a folder name may be or holding a path separator: each is refused 400 /
INVALID_ARGUMENT, over HTTP and gRPC, on a plain app (app.py's lookup) and on a model
repository (model_control.py's), counted in the metrics, with no traceback logged; in a
ModelStreamInfer stream it is that request's `error_message` and the stream goes on.

Typed gRPC contents are estimated at their encoded size against --max-response-bytes (a
negative INT8 takes 10 bytes as a protobuf varint), and a stream whose client does not read
its answers holds at most its bound of them.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpb_grpc

import asyncgraph
from asyncgraph.graph.builder import GraphBuilder
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.serve import InferenceServer, create_app, running_server
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.grpc_server import GrpcEndpoint, add_grpc
from asyncgraph.serve.model_control import add_model_control
from asyncgraph.serve.names import check_name, version_number
from asyncgraph.serve.repository import ModelRepository
from tests.support.models import Affine, export_model
from tests.support.serving import CPU, WAIT_S, eventually, identity_graph, metric

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(120)]

X = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
SUPERSCRIPT = "²"  # str.isdigit() says yes; int() says no
LONG_NAME = "m" * 300  # over a folder name's 255 bytes: ENAMETOOLONG from the repository
LONG_VERSION = "9" * 5000  # digits, past int()'s default limit of 4,300


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    ep = export_model(Affine(), torch.randn(2, 4), dynamic=True)
    path = tmp_path_factory.mktemp("pt2") / "a.pt2"
    torch.export.save(ep, path)
    return path


class Served:
    def __init__(self, server: InferenceServer, http: httpx.AsyncClient, stub: Any,
                 endpoint: GrpcEndpoint) -> None:
        self.server, self.http, self.stub, self.endpoint = server, http, stub, endpoint

    async def metrics(self) -> str:
        return (await self.http.get("/metrics")).text


@asynccontextmanager
async def serving(
    models: dict[str, asyncgraph.Executor], repo: Path | None = None, **grpc_options: Any
) -> AsyncIterator[Served]:
    """The app (with model control over `repo`, its model "a" loaded, when given) and its
    gRPC endpoint, in this loop."""
    app_options = {k: grpc_options.pop(k) for k in ("max_response_bytes",) if k in grpc_options}
    app = create_app(models, calibrate=False, **app_options)
    if repo is not None:
        control = add_model_control(app, ModelRepository(repo), asyncgraph.load, explicit=True,
                                    calibrate=False)
        control.preload(["a"])
    endpoint = add_grpc(app, "127.0.0.1", 0, grace_s=5, **grpc_options)
    async with (
        running_server(app) as url,
        httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http,
        grpc.aio.insecure_channel(endpoint.address) as channel,
    ):
        yield Served(app.state.asyncgraph, http, tpb_grpc.GRPCInferenceServiceStub(channel),
                     endpoint)


@asynccontextmanager
async def serving_a(kind: str, model_file: Path, tmp_path: Path) -> AsyncIterator[Served]:
    """Model "a" (Affine, version 1) served by a plain app or from a model repository."""
    if kind == "plain":
        async with asyncgraph.load(model_file) as ex, serving({"a": ex}) as s:
            yield s
        return
    target = tmp_path / "repo" / "a" / "1" / "model.pt2"
    target.parent.mkdir(parents=True)
    shutil.copyfile(model_file, target)
    async with serving({}, tmp_path / "repo") as s:
        yield s


@pytest.fixture
def tracebacks() -> Iterator[list[logging.LogRecord]]:
    """The records logged with a traceback, by asyncgraph, uvicorn (an ASGI app's uncaught
    error) or grpc, while the test runs (uvicorn's loggers do not propagate to caplog)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info:
                records.append(record)

    handler = Collect(logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("asyncgraph", "uvicorn", "uvicorn.error", "grpc")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def infer_request(model: str, version: str = "", request_id: str = "") -> Any:
    request = tpb.ModelInferRequest(model_name=model, model_version=version, id=request_id,
                                    raw_input_contents=[X.tobytes()])
    request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    return request


def infer_body() -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                        "data": X.reshape(-1).tolist()}]}


# -- names.py -------------------------------------------------------------------------------


def test_versions_are_ascii_digits_that_fit_int64() -> None:
    assert version_number("0") == 0 and version_number("17") == 17
    assert version_number("9223372036854775807") == 2**63 - 1
    for bad in ("", SUPERSCRIPT, "\u0661", "+1", "-1", " 1", "1.0", "0x1", "9223372036854775808",
                LONG_VERSION):
        with pytest.raises(ProtocolError) as refused:
            version_number(bad)
        assert refused.value.status == 400
        assert "expected 1 to 19 ASCII digits" in refused.value.message
        assert len(refused.value.message) < 300  # a hostile value is shown shortened


def test_model_names_are_one_folder_name() -> None:
    for good in ("a", "model.v1", "é" * 127, "x" * 255, "..a"):
        assert check_name(good) == good
    for bad, why in (("", "empty"), (".", "'.'"), ("..", "'..'"), ("a/b", "'/'"),
                     ("a\\b", "'\\\\'"), ("a\0b", "'\\x00'"), ("x" * 256, "256 bytes"),
                     ("é" * 128, "256 bytes"), (LONG_NAME, "300 bytes")):
        with pytest.raises(ProtocolError) as refused:
            check_name(bad)
        assert refused.value.status == 400 and why in refused.value.message, (
            refused.value.message)
        assert len(refused.value.message) < 300


def test_the_repository_never_raises_for_a_hostile_name(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    repository = ModelRepository(tmp_path)
    assert repository.has("a")
    for hostile in (LONG_NAME, "a\0b", "../" + tmp_path.name, ".", "", "x" * 5000):
        assert not repository.has(hostile)  # ENAMETOOLONG, a NUL byte: not a model


# -- the gRPC stream --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "repository"])
async def test_a_stream_answers_each_bad_request_in_stream_and_goes_on(
    kind: str, model_file: Path, tmp_path: Path, tracebacks: list[logging.LogRecord]
) -> None:
    async with serving_a(kind, model_file, tmp_path) as s:
        lookup = s.server.served

        def served(name: str, version: str | None = None) -> Any:
            if name == "boom":
                raise RuntimeError("a lookup that fails unexpectedly")
            return lookup(name, version)

        s.server.served = served  # type: ignore[method-assign]
        requests = [
            infer_request("a", request_id="first"),
            infer_request("a", SUPERSCRIPT, "superscript"),
            infer_request(LONG_NAME, request_id="long-name"),
            infer_request("a", LONG_VERSION, "long-version"),
            infer_request("boom", request_id="boom"),
            infer_request("a", "1", "last"),
        ]
        answers = [a async for a in s.stub.ModelStreamInfer(iter(requests), timeout=WAIT_S)]
        assert [a.infer_response.id for a in answers] == [r.id for r in requests]
        errors = [a.error_message for a in answers]
        assert errors[0] == errors[-1] == ""
        assert "model version '²': expected 1 to 19 ASCII digits" in errors[1], errors[1]
        assert "model name 'mmm" in errors[2] and "300 bytes" in errors[2], errors[2]
        assert "expected 1 to 19 ASCII digits" in errors[3] and len(errors[3]) < 300
        assert errors[4] == "model 'boom': RuntimeError: a lookup that fails unexpectedly"
        for answer in (answers[0], answers[-1]):
            [out] = answer.infer_response.raw_output_contents
            assert len(out) == 2 * 3 * 4
        # the unexpected error is logged once, naming the model; the malformed ones are not
        assert [r.getMessage() for r in tracebacks] == ["model 'boom': request failed"]
        text = await s.metrics()
    assert metric(text, "asyncgraph_unserved_requests_total", route="infer", code="400") == 3
    assert metric(text, "nv_inference_request_success", model="a") == 2


@pytest.mark.parametrize("kind", ["plain", "repository"])
async def test_grpc_calls_refuse_malformed_names_and_versions_as_invalid_argument(
    kind: str, model_file: Path, tmp_path: Path, tracebacks: list[logging.LogRecord]
) -> None:
    async with serving_a(kind, model_file, tmp_path) as s:
        calls = [
            (s.stub.ModelReady, tpb.ModelReadyRequest(name="a", version=SUPERSCRIPT)),
            (s.stub.ModelReady, tpb.ModelReadyRequest(name=LONG_NAME)),
            (s.stub.ModelMetadata, tpb.ModelMetadataRequest(name="a", version=LONG_VERSION)),
            (s.stub.ModelMetadata, tpb.ModelMetadataRequest(name=LONG_NAME)),
            (s.stub.ModelInfer, infer_request("a", SUPERSCRIPT)),
            (s.stub.ModelInfer, infer_request("a/../a")),
        ]
        for call, request in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(request, timeout=WAIT_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                refused.value.details())
        missing = tpb.ModelReadyRequest(name="nope")
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await s.stub.ModelReady(missing, timeout=WAIT_S)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await s.stub.ModelReady(tpb.ModelReadyRequest(name="a"), timeout=WAIT_S)).ready
        text = await s.metrics()
    assert not tracebacks
    for route, count in (("ready", 2), ("metadata", 2), ("infer", 2)):
        assert metric(text, "asyncgraph_unserved_requests_total", route=route,
                      code="400") == count
    assert metric(text, "asyncgraph_unserved_requests_total", route="ready", code="404") == 1


# -- HTTP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "repository"])
async def test_http_refuses_malformed_names_and_versions_with_400_counted_no_traceback(
    kind: str, model_file: Path, tmp_path: Path, tracebacks: list[logging.LogRecord]
) -> None:
    async with serving_a(kind, model_file, tmp_path) as s:
        cases = [
            ("ready", "GET", f"/v2/models/a/versions/{SUPERSCRIPT}/ready", "model version"),
            ("ready", "GET", f"/v2/models/{LONG_NAME}/ready", "model name"),
            ("ready", "GET", f"/v2/models/a/versions/{LONG_VERSION}/ready", "model version"),
            ("metadata", "GET", f"/v2/models/a/versions/{SUPERSCRIPT}", "model version"),
            ("metadata", "GET", f"/v2/models/{LONG_NAME}", "model name"),
            ("infer", "POST", f"/v2/models/a/versions/{SUPERSCRIPT}/infer", "model version"),
            ("infer", "POST", f"/v2/models/{LONG_NAME}/infer", "model name"),
            ("infer", "POST", "/v2/models/a%5Cb/infer", "model name"),
        ]
        if kind == "repository":
            cases.append(("load", "POST", f"/v2/repository/models/{LONG_NAME}/load",
                          "model name"))
        for _route, method, path, what in cases:
            body = infer_body() if path.endswith("/infer") else None
            r = await s.http.request(method, path, json=body)
            assert r.status_code == 400, (path[:60], r.status_code, r.text[:200])
            assert r.json()["error"].startswith(what), r.text[:200]
        unknown = await s.http.get("/v2/models/nope/versions/1/ready")
        assert unknown.status_code == 404
        assert (await s.http.get("/v2/models/a/versions/1/ready")).status_code == 200
        assert (await s.http.post("/v2/models/a/infer", json=infer_body())).status_code == 200
        text = await s.metrics()
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    for route in ("ready", "metadata", "infer", "load"):
        expected = sum(1 for c in cases if c[0] == route)
        if expected:
            assert metric(text, "asyncgraph_unserved_requests_total", route=route,
                          code="400") == expected, route
    assert metric(text, "asyncgraph_unserved_requests_total", route="ready", code="404") == 1
    assert metric(text, "nv_inference_request_success", model="a") == 1


# -- response sizes ---------------------------------------------------------------------------


async def test_a_typed_answer_over_max_response_bytes_is_refused_and_counted() -> None:
    """9,000 INT8 values are 9,000 bytes raw, under a 10,000-byte limit, but 90,000 as
    typed `int_contents` when negative (a varint sign-extends to 10 bytes): estimated raw,
    it was built, refused by grpc itself (RESOURCE_EXHAUSTED) and counted a 200."""
    n = 9000
    async with (
        asyncgraph.Executor(identity_graph(torch.int8, (n,))) as ex,
        serving({"i8": ex}, max_response_bytes=10_000) as s,
    ):
        typed = tpb.ModelInferRequest(model_name="i8")
        typed.inputs.add(name="x", datatype="INT8", shape=[n]).contents.int_contents.extend(
            [-1] * n)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await s.stub.ModelInfer(typed, timeout=WAIT_S)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert "up to 90" in refused.value.details()
        assert "over the limit of 10000 bytes (--max-response-bytes)" in refused.value.details()
        raw = tpb.ModelInferRequest(model_name="i8", raw_input_contents=[b"\xff" * n])
        raw.inputs.add(name="x", datatype="INT8", shape=[n])
        answer = await s.stub.ModelInfer(raw, timeout=WAIT_S)
        assert answer.raw_output_contents[0] == b"\xff" * n
        text = await s.metrics()
    assert metric(text, "asyncgraph_requests_total", model="i8", code="400") == 1
    assert metric(text, "nv_inference_request_failure", model="i8", reason="OTHER") == 1
    assert metric(text, "nv_inference_request_success", model="i8") == 1


def widening_graph(k: int) -> Graph:
    """x (FP32 [2]) -> x repeated k times: a small request with a large answer."""
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(lambda t: t.repeat(k), x, name="widen")
    b.output(y)
    graph = b.build()
    graph.values[x.id].spec = TensorSpec(torch.float32, CPU, (2,), (2,))
    graph.values[y.id].spec = TensorSpec(torch.float32, CPU, (2 * k,), (2 * k,))
    return graph


@pytest.mark.parametrize("bound", ["stream", "server"])
async def test_a_stream_whose_client_does_not_read_holds_at_most_its_bound(
    bound: str,
) -> None:
    """60 requests of 256 KB answers on a stream whose client reads nothing until later:
    grpc takes some answers into its buffers, then the server held every other one that
    completed (up to the stream's window of 64, each up to --max-response-bytes). Now the
    answers waiting for the client are bounded in bytes, per stream and across streams:
    one past the bound is that request's RESOURCE_EXHAUSTED error, and the stream goes on."""
    k, cap = 32 << 10, 300_000
    limits = ({"stream_held_bytes": 2 * cap} if bound == "stream"
              else {"stream_held_bytes": 100 * cap, "held_bytes": 2 * cap})
    request = tpb.ModelInferRequest(model_name="w", raw_input_contents=[b"\0" * 8])
    request.inputs.add(name="x", datatype="FP32", shape=[2])
    async with (
        asyncgraph.Executor(widening_graph(k)) as ex,
        serving({"w": ex}, max_response_bytes=cap, **limits) as s,
    ):
        call = s.stub.ModelStreamInfer(iter([request] * 60), timeout=WAIT_S * 2)
        await eventually(
            lambda: s.server.metrics.counters.get("w") is not None
            and s.server.metrics.counters["w"].failure.get("OTHER", 0) > 0,
            "an answer refused while the client does not read",
        )
        held = s.endpoint.held
        assert 0 < held.peak <= 2 * cap
        answers = [a async for a in call]
        assert len(answers) == 60  # every request answered, the stream not ended
        refused = [a.error_message for a in answers if a.error_message]
        assert refused and all(
            "wait for their client to read them" in e and ("this stream" if bound == "stream" else
                                               "all streams") in e for e in refused
        ), refused[:2]
        for a in answers:
            if not a.error_message:
                assert len(a.infer_response.raw_output_contents[0]) == 2 * k * 4
        assert held.held == 0 and held.peak <= 2 * cap
        text = await s.metrics()
    assert metric(text, "asyncgraph_requests_total", model="w", code="429") == len(refused)
