"""The gRPC endpoint (`inference.GRPCInferenceService`) beside HTTP, in one process.

Each test runs the HTTP app with its gRPC endpoint inside its own event loop
(`running_server` + `add_grpc` on a free port) and talks to it with the stock
tritonclient.grpc.aio client, and with plain grpc stubs (tritonclient's own generated
`service_pb2`) where the client has no way to say it: typed contents, cancelling a call,
trailing metadata.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc import service_pb2 as tpb
from tritonclient.grpc import service_pb2_grpc as tpb_grpc
from tritonclient.utils import InferenceServerException

import asyncgraph
from asyncgraph.serve import InferenceServer, create_app, running_server
from asyncgraph.serve.grpc_server import add_grpc
from tests.support.models import Affine
from tests.support.serving import Gate, eventually, gated_graph, metric, save_linear, serve

pytestmark = pytest.mark.usefixtures("leak_check")

WAIT_S = 20.0


@pytest.fixture(scope="module")
def linear() -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = Affine().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    return model, ep


class Served:
    def __init__(self, server: InferenceServer, http: httpx.AsyncClient, target: str,
                 client: tga.InferenceServerClient, stub: Any) -> None:
        self.server, self.http, self.target, self.client, self.stub = (
            server, http, target, client, stub
        )

    async def metrics(self) -> str:
        return (await self.http.get("/metrics")).text


@asynccontextmanager
async def serving(models: dict[str, asyncgraph.Executor], **options: Any) -> AsyncIterator[Served]:
    options.setdefault("calibrate", False)
    app = create_app(models, **options)
    endpoint = add_grpc(app, "127.0.0.1", 0, grace_s=5)
    async with (
        running_server(app) as url,
        httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http,
        grpc.aio.insecure_channel(endpoint.address) as channel,
    ):
        client = tga.InferenceServerClient(endpoint.address)
        try:
            yield Served(app.state.asyncgraph, http, endpoint.address, client,
                         tpb_grpc.GRPCInferenceServiceStub(channel))
        finally:
            await client.close()


def raw_input(x: np.ndarray, name: str = "x") -> InferInput:
    tensor = InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def typed_request(model: str, x: np.ndarray, **fields: Any) -> Any:
    request = tpb.ModelInferRequest(model_name=model, **fields)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    return request


def gated_request() -> Any:
    """A raw ModelInferRequest for gated_graph's model "g": two FP32 zeros."""
    request = tpb.ModelInferRequest(model_name="g", raw_input_contents=[b"\0" * 8])
    request.inputs.add(name="x", datatype="FP32", shape=[2])
    return request


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status())


# -- endpoints ------------------------------------------------------------------------------


async def test_health_and_metadata(linear: Any) -> None:
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        assert await s.client.is_server_live()
        assert await s.client.is_server_ready()
        assert await s.client.is_model_ready("lin")
        assert await s.client.is_model_ready("lin", "1")
        meta = await s.client.get_server_metadata(as_json=True)
        assert meta["name"] == "asyncgraph"
        model = await s.client.get_model_metadata("lin", as_json=True)
        assert model["name"] == "lin" and model["versions"] == ["1"]
        assert model["platform"] == "asyncgraph"
        assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
        assert model["outputs"] == [
            {"name": "output_0", "datatype": "FP32", "shape": ["-1", "3"]}
        ]
        with pytest.raises(InferenceServerException) as missing:
            await s.client.get_model_metadata("nope")
        assert code_of(missing.value) == "StatusCode.NOT_FOUND"
        assert "unknown model 'nope'; serving 'lin'" in missing.value.message()
        with pytest.raises(InferenceServerException) as version:
            await s.client.is_model_ready("lin", "2")
        assert code_of(version.value) == "StatusCode.NOT_FOUND"


async def test_raw_inference_equals_eager(linear: Any) -> None:
    model, ep = linear
    x = np.random.default_rng(0).standard_normal((5, 4), dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        result = await s.client.infer("lin", [raw_input(x)], request_id="r-1",
                                      outputs=[InferRequestedOutput("output_0")])
        np.testing.assert_allclose(result.as_numpy("output_0"), expected, rtol=1e-5, atol=1e-6)
        response = result.get_response()
        assert response.id == "r-1" and response.model_name == "lin"
        assert len(response.raw_output_contents) == 1  # raw in, raw out
        assert ex.statistics().completed == 1
        text = await s.metrics()
    assert metric(text, "nv_inference_request_success", model="lin") == 1
    assert metric(text, "asyncgraph_requests_total", model="lin", code="200") == 1


async def test_typed_contents_are_answered_typed(linear: Any) -> None:
    model, ep = linear
    x = np.random.default_rng(1).standard_normal((3, 4), dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        response = await s.stub.ModelInfer(typed_request("lin", x, id="t"), timeout=WAIT_S)
        assert response.id == "t" and not response.raw_output_contents
        [out] = response.outputs
        assert out.name == "output_0" and out.datatype == "FP32" and list(out.shape) == [3, 3]
        got = np.array(out.contents.fp32_contents, np.float32).reshape(3, 3)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert ex.statistics().completed == 1


# -- errors ---------------------------------------------------------------------------------


async def test_invalid_requests_are_invalid_argument_naming_the_field(linear: Any) -> None:
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        bad_shape = np.zeros((2, 5), np.float32)
        with pytest.raises(InferenceServerException) as shape:
            await s.client.infer("lin", [raw_input(bad_shape)])
        assert code_of(shape.value) == "StatusCode.INVALID_ARGUMENT"
        assert "inputs[0] ('x').shape[1]" in shape.value.message()

        with pytest.raises(InferenceServerException) as name:
            await s.client.infer("lin", [raw_input(np.zeros((2, 4), np.float32), "y")])
        assert code_of(name.value) == "StatusCode.INVALID_ARGUMENT"
        assert "unknown input 'y'" in name.value.message() and "'x'" in name.value.message()

        short = tpb.ModelInferRequest(model_name="lin")
        short.inputs.add(name="x", datatype="FP32", shape=[2, 4])
        short.raw_input_contents.append(b"\0" * 28)
        with pytest.raises(grpc.aio.AioRpcError) as size:
            await s.stub.ModelInfer(short, timeout=WAIT_S)
        assert size.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert size.value.details() == (
            "inputs[0] ('x').raw_input_contents: expected 32 bytes for FP32 [2, 4], got 28"
        )

        few = typed_request("lin", np.zeros(7, np.float32))
        few.inputs[0].shape[:] = [2, 4]
        with pytest.raises(grpc.aio.AioRpcError) as count:
            await s.stub.ModelInfer(few, timeout=WAIT_S)
        assert count.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "inputs[0] ('x').contents: expected 8 element(s)" in count.value.details()

        wrong = tpb.ModelInferRequest(model_name="lin")
        tensor = wrong.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        tensor.contents.int64_contents.extend([1, 2, 3, 4])
        with pytest.raises(grpc.aio.AioRpcError) as field:
            await s.stub.ModelInfer(wrong, timeout=WAIT_S)
        assert field.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "contents.int64_contents" in field.value.details()
        assert "fp32_contents" in field.value.details()

        with pytest.raises(InferenceServerException) as unknown:
            await s.client.infer("nope", [raw_input(np.zeros((2, 4), np.float32))])
        assert code_of(unknown.value) == "StatusCode.NOT_FOUND"
        assert ex.statistics().completed == 0
        text = await s.metrics()
    assert metric(text, "nv_inference_request_failure", model="lin", reason="OTHER") == 5


async def test_overload_is_unavailable_with_a_retry_hint() -> None:
    gate = Gate()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    async with asyncgraph.Executor(gated_graph(gate), config) as ex, serving(
        {"g": ex}, max_queue=0
    ) as s:
        held = asyncio.ensure_future(
            s.client.infer("g", [raw_input(np.ones(2, np.float32))])
        )
        await asyncio.wait_for(gate.started.wait(), WAIT_S)
        request = gated_request()
        call = s.stub.ModelInfer(request, timeout=WAIT_S)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "overloaded" in refused.value.details()
        assert ("retry-after", "1") in tuple(refused.value.trailing_metadata())
        gate.release.set()
        result = await held
        np.testing.assert_array_equal(result.as_numpy("output_0"), [2.0, 2.0])
        text = await s.metrics()
    assert metric(text, "nv_inference_request_failure", model="g", reason="REJECTED") == 1
    assert metric(text, "nv_inference_request_success", model="g") == 1


async def test_a_short_client_deadline_cancels_the_execution() -> None:
    gate = Gate()
    async with asyncgraph.Executor(gated_graph(gate)) as ex, serving({"g": ex}) as s:
        with pytest.raises(InferenceServerException) as late:
            await s.client.infer("g", [raw_input(np.ones(2, np.float32))], client_timeout=0.2)
        assert code_of(late.value) == "StatusCode.DEADLINE_EXCEEDED"
        await eventually(lambda: gate.cancelled == 1, "the execution cancelled")
        await eventually(lambda: ex.statistics().frames.in_use == 0, "the frame back")
        assert ex.statistics().cancelled == 1
        await eventually(lambda: bool(s.server.metrics.counters["g"].failure), "counted")
        text = await s.metrics()
    assert metric(text, "nv_inference_request_failure", model="g", reason="CANCELED") == 1
    assert metric(text, "nv_inference_request_success", model="g") == 0


async def test_a_client_cancel_cancels_the_execution() -> None:
    gate = Gate()
    async with asyncgraph.Executor(gated_graph(gate)) as ex, serving({"g": ex}) as s:
        request = gated_request()
        call = s.stub.ModelInfer(request, timeout=WAIT_S)
        await asyncio.wait_for(gate.started.wait(), WAIT_S)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await eventually(lambda: gate.cancelled == 1, "the execution cancelled")
        await eventually(lambda: ex.statistics().frames.in_use == 0, "the frame back")
        await eventually(lambda: bool(s.server.metrics.counters["g"].failure), "counted")
        text = await s.metrics()
    assert metric(text, "nv_inference_request_failure", model="g", reason="CANCELED") == 1
    assert metric(text, "asyncgraph_requests_total", model="g", code="499") == 1


async def test_a_server_timeout_is_deadline_exceeded() -> None:
    gate = Gate()
    async with asyncgraph.Executor(gated_graph(gate)) as ex, serving(
        {"g": ex}, timeout_ms=50
    ) as s:
        with pytest.raises(InferenceServerException) as late:
            await s.client.infer("g", [raw_input(np.ones(2, np.float32))])
        assert code_of(late.value) == "StatusCode.DEADLINE_EXCEEDED"
        assert "50 ms timeout" in late.value.message() and "cancelled" in late.value.message()
        assert gate.cancelled == 1 and ex.statistics().frames.in_use == 0
        text = await s.metrics()
    assert metric(text, "nv_inference_request_failure", model="g", reason="CANCELED") == 1


# -- streaming ------------------------------------------------------------------------------


async def test_stream_answers_in_order_and_goes_on_after_an_error(linear: Any) -> None:
    model, ep = linear
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((i + 1, 4), dtype=np.float32) for i in range(5)]

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for i, x in enumerate(xs):
            if i == 2:  # an invalid one in the middle
                yield {"model_name": "lin", "inputs": [raw_input(np.zeros((1, 9), np.float32))],
                       "request_id": "bad"}
            yield {"model_name": "lin", "inputs": [raw_input(x)], "request_id": f"r{i}"}

    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        answers = []
        async for result, error in s.client.stream_infer(requests(), stream_timeout=WAIT_S):
            answers.append((result, error))
        assert len(answers) == 6
        ok = [(r, e) for r, e in answers if e is None]
        errors = [e for _, e in answers if e is not None]
        assert [r.get_response().id for r, _ in ok] == [f"r{i}" for i in range(5)]
        assert [r for r, e in answers].index(None) == 2  # answered in order
        [error] = errors
        assert "inputs[0] ('x').shape[1]" in error.message()
        for (result, _), x in zip(ok, xs, strict=True):
            with torch.no_grad():
                expected = model(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(result.as_numpy("output_0"), expected, rtol=1e-5, atol=1e-6)
        assert ex.statistics().completed == 5
        # the error names the request it answers (its model and id), as Triton's do
        bad = tpb.ModelInferRequest(model_name="nope", id="bad")
        [answer] = [r async for r in s.stub.ModelStreamInfer(iter([bad]), timeout=WAIT_S)]
        assert answer.error_message == "unknown model 'nope'; serving 'lin'"
        assert (answer.infer_response.model_name, answer.infer_response.id) == ("nope", "bad")


async def test_cancelling_a_stream_cancels_its_executions() -> None:
    gate = Gate()
    async with asyncgraph.Executor(gated_graph(gate)) as ex, serving({"g": ex}) as s:
        request = gated_request()
        call = s.stub.ModelStreamInfer(iter([request, request]), timeout=WAIT_S)
        await eventually(lambda: gate.calls == 2, "both requests running")
        call.cancel()
        await eventually(lambda: gate.cancelled == 2, "both executions cancelled")
        await eventually(lambda: ex.statistics().frames.in_use == 0, "the frames back")
        await eventually(
            lambda: s.server.metrics.counters["g"].failure.get("CANCELED") == 2, "counted"
        )


async def test_methods_it_does_not_serve_are_unimplemented(linear: Any) -> None:
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        with pytest.raises(InferenceServerException) as trace:
            await s.client.get_trace_settings("lin")
        assert code_of(trace.value) == "StatusCode.UNIMPLEMENTED"


async def test_shutdown_drains_the_calls_in_flight() -> None:
    gate = Gate()
    async with asyncgraph.Executor(gated_graph(gate)) as ex:
        app = create_app({"g": ex}, calibrate=False)
        endpoint = add_grpc(app, "127.0.0.1", 0, grace_s=WAIT_S)
        server: InferenceServer = app.state.asyncgraph

        async def release_once_draining() -> None:
            await eventually(lambda: server.shutting_down, "the drain started")
            gate.release.set()

        async with running_server(app):
            client = tga.InferenceServerClient(endpoint.address)
            call = asyncio.ensure_future(client.infer("g", [raw_input(np.ones(2, np.float32))]))
            await asyncio.wait_for(gate.started.wait(), WAIT_S)
            releaser = asyncio.ensure_future(release_once_draining())
        # the server has stopped: the call in flight was answered first
        await releaser
        result = await call
        await client.close()
        np.testing.assert_array_equal(result.as_numpy("output_0"), [2.0, 2.0])
        assert gate.cancelled == 0


# -- one process, two transports ------------------------------------------------------------


async def test_http_and_grpc_share_one_executor_and_metrics(linear: Any) -> None:
    _, ep = linear
    x = np.ones((2, 4), np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4],
                        "data": x.reshape(-1).tolist()}]}
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as s:
        http = [s.http.post("/v2/models/lin/infer", json=body) for _ in range(6)]
        grpc_calls = [s.client.infer("lin", [raw_input(x)]) for _ in range(6)]
        results = await asyncio.gather(*http, *grpc_calls)
        assert all(r.status_code == 200 for r in results[:6])
        np.testing.assert_allclose(
            results[6].as_numpy("output_0"),
            np.array(results[0].json()["outputs"][0]["data"], np.float32).reshape(2, 3),
            rtol=1e-5, atol=1e-6,
        )
        assert ex.statistics().completed == 12
        text = await s.metrics()
    assert metric(text, "nv_inference_request_success", model="lin") == 12
    assert metric(text, "nv_inference_count", model="lin") == 12


# -- the command line -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_linear(tmp_path_factory.mktemp("models") / "lin.pt2")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_serves_grpc_beside_http_and_stops_cleanly(
    model_file: Path, sig: signal.Signals
) -> None:
    grpc_port = _free_port()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with serve(str(model_file), "--port", "0", "--grpc-port", str(grpc_port)) as served:
        served.wait_for(rf"gRPC \(inference.GRPCInferenceService\) on 127.0.0.1:{grpc_port}")
        url = served.wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)").group(1)
        client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            tensor = tg.InferInput("input", [2, 4], "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer("lin", [tensor], client_timeout=WAIT_S)
            assert result.as_numpy("output_0").shape == (2, 3)
        finally:
            client.close()
        text = httpx.get(f"{url}/metrics", timeout=WAIT_S).text
        assert metric(text, "nv_inference_request_success", model="lin") == 1
        served.proc.send_signal(sig)
        assert served.proc.wait(timeout=60) == 0, served.output()
        output = served.output()
    assert "server stopped" in output and "Traceback" not in output, output
