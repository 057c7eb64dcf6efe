"""The Open Inference Protocol server, on a real uvicorn server on 127.0.0.1 (a free port).

Each test starts the server inside its own event loop with `running_server` (so the server runs
on asyncio in debug mode and on uvloop, like every async test), talks to it with httpx, with raw
sockets, and with the stock tritonclient.http client (blocking, so on a thread), and stops it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

import asyncgraph
from asyncgraph.serve import InferenceServer, ProtocolError, create_app, running_server
from asyncgraph.serve import app as app_module
from asyncgraph.serve import core as core_module
from asyncgraph.testing import FaultInjector
from tests.support.models import Affine
from tests.support.serving import WAIT_S, Gate, eventually, gated_graph, metric

pytestmark = pytest.mark.usefixtures("leak_check")



@pytest.fixture(scope="module")
def linear() -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = Affine().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    return model, ep


@asynccontextmanager
async def serving(
    models: dict[str, asyncgraph.Executor],
    *,
    clock: Callable[[], float] | None = None,
    **options: Any,
) -> AsyncIterator[tuple[InferenceServer, httpx.AsyncClient, str]]:
    """A running server for `models`; `clock` becomes every admission gate's clock before the
    server starts (so start-up calibration is timed on it too). The app calibrates its gates
    at start-up only where a test asks (`calibrate=True`): calibration executes the model,
    which counts in the executor's statistics and would block a gated kernel."""
    options.setdefault("calibrate", False)
    app = create_app(models, **options)
    if clock is not None:
        for name in models:
            app.state.asyncgraph.served(name).admission.clock = clock
    limits = httpx.Limits(max_connections=256)
    # The server keeps idle connections past any test's length: with uvicorn's 5 s default, a
    # pooled connection idle through a slow burst was closed as the client reused it ("Server
    # disconnected without sending a response", once, on a loaded machine).
    async with (
        running_server(app, timeout_keep_alive=int(WAIT_S) * 3) as url,
        httpx.AsyncClient(base_url=url, timeout=WAIT_S, limits=limits) as client,
    ):
        yield app.state.asyncgraph, client, url



def infer_body(x: torch.Tensor, name: str = "x", **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                        "data": x.reshape(-1).tolist()}], **extra}



# -- endpoints ------------------------------------------------------------------------------


async def test_health_and_metadata(linear: Any) -> None:
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (_, client, _url):
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        assert (await client.get("/v2/health/ready")).status_code == 200
        meta = (await client.get("/v2")).json()
        assert meta["name"] == "asyncgraph" and "binary_tensor_data" in meta["extensions"]
        model = (await client.get("/v2/models/lin")).json()
        assert model["name"] == "lin" and model["versions"] == ["1"]
        assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
        assert model["outputs"] == [{"name": "output_0", "datatype": "FP32", "shape": [-1, 3]}]
        assert (await client.get("/v2/models/lin/versions/1")).json() == model
        ready = await client.get("/v2/models/lin/ready")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        missing = await client.get("/v2/models/nope")
        assert missing.status_code == 404
        assert missing.json() == {"error": "unknown model 'nope'; serving 'lin'"}
        wrong = await client.get("/v2/models/lin/versions/2")
        assert wrong.status_code == 404 and "no version '2'" in wrong.json()["error"]
        path = await client.get("/v2/nothing/here")
        assert path.status_code == 404
        assert path.json() == {"error": "GET /v2/nothing/here: Not Found"}
        method = await client.get("/v2/models/lin/infer")
        assert method.status_code == 405 and "Method Not Allowed" in method.json()["error"]


async def test_json_and_binary_inference_equal_eager(linear: Any) -> None:
    model, ep = linear
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = model(x)
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (_, client, _url):
        r = await client.post("/v2/models/lin/infer", json=infer_body(x, id="req-1"))
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["id"] == "req-1" and doc["model_name"] == "lin"
        [out] = doc["outputs"]
        assert out["name"] == "output_0" and out["shape"] == [5, 3]
        torch.testing.assert_close(torch.tensor(out["data"]).reshape(5, 3), expected)

        header = json.dumps({
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [5, 4],
                        "parameters": {"binary_data_size": 80}}],
            "outputs": [{"name": "output_0", "parameters": {"binary_data": True}}],
        }).encode()
        r = await client.post(
            "/v2/models/lin/infer", content=header + x.numpy().tobytes(),
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        assert r.status_code == 200, r.text
        n = int(r.headers["Inference-Header-Content-Length"])
        meta = json.loads(r.content[:n])
        assert meta["outputs"][0]["parameters"] == {"binary_data_size": 60}
        got = torch.from_numpy(np.frombuffer(r.content[n:], dtype=np.float32).copy())
        torch.testing.assert_close(got.reshape(5, 3), expected)
        assert ex.statistics().completed == 2


async def test_tritonclient_json_and_binary(linear: Any) -> None:
    model, ep = linear
    x = np.random.default_rng(0).standard_normal((3, 4), dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()

    def client_calls(url: str) -> dict[str, Any]:
        client = th.InferenceServerClient(url.removeprefix("http://"), network_timeout=WAIT_S)
        try:
            found: dict[str, Any] = {
                "live": client.is_server_live(),
                "ready": client.is_server_ready() and client.is_model_ready("lin"),
                "metadata": client.get_model_metadata("lin"),
            }
            binary = th.InferInput("x", [3, 4], "FP32")
            binary.set_data_from_numpy(x)  # the client's defaults: binary in and out
            found["binary"] = client.infer("lin", [binary]).as_numpy("output_0")
            plain = th.InferInput("x", [3, 4], "FP32")
            plain.set_data_from_numpy(x, binary_data=False)
            wanted = [th.InferRequestedOutput("output_0", binary_data=False)]
            result = client.infer("lin", [plain], outputs=wanted)
            found["json"] = result.as_numpy("output_0")
            found["json_response"] = result.get_response()
            bad = th.InferInput("y", [3, 4], "FP32")
            bad.set_data_from_numpy(x)
            try:
                client.infer("lin", [bad])
            except InferenceServerException as exc:
                found["error"] = (exc.status(), exc.message())
            return found
        finally:
            client.close()

    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (_, _client, url):
        found = await asyncio.to_thread(client_calls, url)
    assert found["live"] and found["ready"]
    assert found["metadata"]["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, 4]}
    np.testing.assert_allclose(found["binary"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(found["json"], expected, rtol=1e-6, atol=1e-6)
    assert "data" in found["json_response"]["outputs"][0]
    status, message = found["error"]
    assert status == "400" and "inputs[0].name: unknown input 'y'" in message


@pytest.mark.parametrize("batching", [False, True], ids=["alone", "batched"])
async def test_200_concurrent_requests(linear: Any, batching: bool) -> None:
    model, ep = linear
    xs = [torch.randn(1 + i % 4, 4) for i in range(200)]
    with torch.no_grad():
        expected = [model(x) for x in xs]
    config = asyncgraph.ExecutorConfig(
        max_concurrent_executions=4,
        batching=asyncgraph.BatchingConfig(max_batch_size=32) if batching else None,
    )
    async with asyncgraph.Executor(ep, config) as ex, serving({"lin": ex}, max_queue=256) as (
        _, client, _url
    ):
        responses = await asyncio.gather(
            *(client.post("/v2/models/lin/infer", json=infer_body(x)) for x in xs)
        )
        for r, x, want in zip(responses, xs, expected, strict=True):
            assert r.status_code == 200, r.text
            got = torch.tensor(r.json()["outputs"][0]["data"]).reshape(len(x), 3)
            torch.testing.assert_close(got, want)
        text = (await client.get("/metrics")).text
        stats = ex.statistics()
        batches = ex.batching_statistics()
    if batching:  # requests that arrived while a batch ran were stacked into the next one
        assert batches is not None and batches.requests == 200
        assert stats.completed == batches.batches < 200
        assert metric(text, "nv_inference_exec_count", model="lin", version="1") == batches.batches
        assert metric(text, "asyncgraph_batches_total", model="lin") == batches.batches
        assert metric(text, "asyncgraph_batch_rows_total", model="lin") == sum(len(x) for x in xs)
        assert metric(text, "asyncgraph_batch_queued_requests", model="lin") == 0
    else:
        assert stats.completed == 200
    assert stats.frames.in_use == 0
    assert stats.frames.high_water <= 4
    assert metric(text, "nv_inference_request_success", model="lin", version="1") == 200
    assert metric(text, "asyncgraph_requests_total", model="lin", code="200") == 200
    assert metric(text, "asyncgraph_request_duration_seconds_count", model="lin") == 200
    assert metric(text, "nv_inference_queue_duration_us", model="lin") >= 0


@pytest.mark.timeout(120)
async def test_a_200_request_burst_at_default_settings_gets_200_successes(linear: Any) -> None:
    """The issue's new user: default executor, default app, 200 concurrent JSON requests on a
    small model. No deadline is set, so admission holds them all (up to its memory caps)."""
    model, ep = linear
    xs = [torch.randn(1 + i % 4, 4, generator=torch.Generator().manual_seed(i))
          for i in range(200)]
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (server, client, _url):
        responses = await asyncio.gather(
            *(client.post("/v2/models/lin/infer", json=infer_body(x)) for x in xs)
        )
        text = (await client.get("/metrics")).text
        admission = server.served("lin").admission
        assert admission.running == 0 and admission.queued == 0
    assert [r.status_code for r in responses] == [200] * 200, {
        r.status_code: r.text for r in responses if r.status_code != 200
    }
    with torch.no_grad():
        for r, x in zip(responses, xs, strict=True):
            got = torch.tensor(r.json()["outputs"][0]["data"]).reshape(len(x), 3)
            torch.testing.assert_close(got, model(x))
    assert ex.statistics().completed == 200
    assert metric(text, "nv_inference_request_success", model="lin", version="1") == 200
    assert metric(text, "nv_inference_request_failure", model="lin", reason="REJECTED") == 0


@pytest.mark.timeout(60)
async def test_batches_through_the_server_fill_to_max_batch_size(linear: Any) -> None:
    """The server admits enough requests to fill a batch, not one per frame: 64 one-row
    requests queue behind a held batch, then leave in batches of 32 rows."""
    model, ep = linear
    faults = FaultInjector()
    gate = faults.block("linear")
    config = asyncgraph.ExecutorConfig(
        max_concurrent_executions=4, heavy_op_flops=0, adaptive_placement=False,
        batching=asyncgraph.BatchingConfig(max_batch_size=32, max_concurrent_batches=1),
    )
    xs = [torch.randn(1, 4, generator=torch.Generator().manual_seed(i)) for i in range(64)]
    ex = asyncgraph.Executor(ep, config, kernel_factory=faults.kernel_factory())
    async with ex, serving({"lin": ex}, max_queue=256) as (_, client, _url):
        first = asyncio.create_task(client.post("/v2/models/lin/infer", json=infer_body(xs[0])))
        await gate.wait_entered(1)
        rest = [asyncio.create_task(client.post("/v2/models/lin/infer", json=infer_body(x)))
                for x in xs[1:]]

        def queued() -> int:
            stats = ex.batching_statistics()
            return stats.queued if stats is not None else 0

        try:
            await eventually(lambda: queued() == 63, "63 requests wait in the batcher")
        finally:
            gate.open()  # a failure must not leave a worker thread blocked
        responses = await asyncio.gather(first, *rest)
        batches = ex.batching_statistics()
    for r, x in zip(responses, xs, strict=True):
        assert r.status_code == 200, r.text
        with torch.no_grad():
            torch.testing.assert_close(torch.tensor(r.json()["outputs"][0]["data"]), model(x)[0])
    assert batches is not None and batches.largest_batch == 32
    assert batches.batches == 3  # the held one, then 32 and 31 rows


# -- cancellation, backpressure, timeouts ---------------------------------------------------


async def test_client_disconnect_cancels_the_execution() -> None:
    gate = Gate()
    async with asyncgraph.Executor(gated_graph(gate)) as ex, serving({"g": ex}) as (
        server, _client, url
    ):
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(infer_body(torch.ones(2))).encode()
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v2/models/g/infer HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            await gate.started.wait()
        assert ex.statistics().frames.in_use == 1
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: ex.statistics().frames.in_use == 0, "the frame came back")
        await eventually(lambda: ex.statistics().cancelled == 1, "the execution was cancelled")
        assert gate.cancelled == 1
        # the failure is counted when the cancelled request's handler returns, after the
        # frame is back: wait for that event, not for a time
        await eventually(
            lambda: metric(server.metrics.render().decode(), "nv_inference_request_failure",
                           model="g", reason="CANCELED") == 1,
            "the cancellation is counted as CANCELED",
        )
        served = server.served("g")
        assert served.admission.running == 0 and served.admission.queued == 0
        text = server.metrics.render().decode()
        assert metric(text, "nv_inference_request_failure", model="g", reason="BACKEND") == 0


async def test_overload_answers_503_at_once() -> None:
    gate = Gate()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    async with asyncgraph.Executor(gated_graph(gate), config) as ex, serving(
        {"g": ex}, max_queue=1
    ) as (server, client, _url):
        body = infer_body(torch.ones(2))
        first = asyncio.create_task(client.post("/v2/models/g/infer", json=body))
        async with asyncio.timeout(WAIT_S):
            await gate.started.wait()
        second = asyncio.create_task(client.post("/v2/models/g/infer", json=body))
        admission = server.served("g").admission
        await eventually(lambda: admission.queued == 1, "the second request is queued")
        refused = await client.post("/v2/models/g/infer", json=body)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json() == {"error": refused.json()["error"]}
        assert "overloaded" in refused.json()["error"]
        assert gate.calls == 1  # the refused request reached no kernel
        gate.release.set()
        done = await asyncio.gather(first, second)
        assert [r.status_code for r in done] == [200, 200]
        assert done[0].json()["outputs"][0]["data"] == [2.0, 2.0]
        text = (await client.get("/metrics")).text
        assert metric(text, "nv_inference_request_failure", model="g", reason="REJECTED") == 1
        assert metric(text, "nv_inference_request_success", model="g") == 2


class FakeClock:
    """The admission gate's clock, advanced by the test: service times without sleeping."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def measured_slow_service(
    server: InferenceServer, client: httpx.AsyncClient, gate: Gate, service_s: float
) -> None:
    """One request through the gated model that holds its slot `service_s` on a fake clock:
    the gate then measures a service rate of 1 / service_s (one frame)."""
    clock = FakeClock()
    server.served("g").admission.clock = clock
    first = asyncio.create_task(client.post("/v2/models/g/infer", json=infer_body(torch.ones(2))))
    async with asyncio.timeout(WAIT_S):
        await gate.started.wait()
    clock.now += service_s
    gate.release.set()
    assert (await first).status_code == 200
    gate.release.clear()
    gate.started.clear()
    assert server.served("g").admission.mean_service_s == service_s


@pytest.mark.timeout(60)
async def test_sustained_overload_is_refused_at_once_by_deadline() -> None:
    """Service measured at 10 s a request, a 5 s deadline: with the one frame busy, every new
    request expects to finish in 20 s and is refused (503) on arrival, before it runs."""
    gate = Gate()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    async with asyncgraph.Executor(gated_graph(gate), config) as ex, serving(
        {"g": ex}, timeout_ms=5000
    ) as (server, client, _url):
        await measured_slow_service(server, client, gate, 10.0)
        body = infer_body(torch.ones(2))
        held = asyncio.create_task(client.post("/v2/models/g/infer", json=body))
        async with asyncio.timeout(WAIT_S):
            await gate.started.wait()
        burst = await asyncio.gather(
            *(client.post("/v2/models/g/infer", json=body) for _ in range(20))
        )
        calls = gate.calls
        text = (await client.get("/metrics")).text
        gate.release.set()
        assert (await held).status_code == 200
    assert calls == 2  # the measured one and the held one: no refused request ran
    for r in burst:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert "overloaded" in error and "expected to finish in 20000 ms" in error, error
    assert metric(text, "asyncgraph_admission_refusals_total", model="g", reason="deadline") == 20
    assert metric(text, "asyncgraph_admission_refusals_total", model="g", reason="max_queue") == 0
    assert metric(text, "nv_inference_request_failure", model="g", reason="REJECTED") == 20
    assert metric(text, "nv_inference_request_success", model="g") == 1
    assert metric(text, "asyncgraph_service_rate", model="g") == pytest.approx(0.1)
    assert metric(text, "asyncgraph_expected_wait_seconds", model="g") == pytest.approx(10.0)
    assert ex.statistics().completed == 2


@pytest.mark.timeout(60)
async def test_a_requests_own_timeout_refuses_it_when_it_cannot_make_it() -> None:
    """No server timeout: a request without a timeout of its own waits for its turn; one whose
    Triton `parameters.timeout` (microseconds) is shorter than the expected wait is refused
    once its body is decoded, before it runs."""
    gate = Gate()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    async with asyncgraph.Executor(gated_graph(gate), config) as ex, serving({"g": ex}) as (
        server, client, _url
    ):
        await measured_slow_service(server, client, gate, 10.0)
        held = asyncio.create_task(
            client.post("/v2/models/g/infer", json=infer_body(torch.ones(2)))
        )
        async with asyncio.timeout(WAIT_S):
            await gate.started.wait()
        patient = asyncio.create_task(
            client.post("/v2/models/g/infer", json=infer_body(torch.ones(2)))
        )
        admission = server.served("g").admission
        await eventually(lambda: len(admission._waiters) == 1, "the patient one waits")
        hurried = await client.post(
            "/v2/models/g/infer", json=infer_body(torch.ones(2), parameters={"timeout": 30_000_000})
        )
        assert hurried.status_code == 503, hurried.text
        assert "1 request(s) ahead" in hurried.json()["error"]
        assert gate.calls == 2
        gate.release.set()
        assert [(await t).status_code for t in (held, patient)] == [200, 200]
        text = (await client.get("/metrics")).text
    assert metric(text, "asyncgraph_admission_refusals_total", model="g", reason="deadline") == 1
    assert ex.statistics().completed == 3


@pytest.mark.timeout(60)
async def test_a_deadline_that_passes_while_queued_answers_504_without_running() -> None:
    """Measured at 1 ms a request, a request with its own 50 ms timeout is admitted behind a
    held execution; the timeout passes while it waits: 504, and it never reaches the kernel."""
    gate = Gate()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    async with asyncgraph.Executor(gated_graph(gate), config) as ex, serving({"g": ex}) as (
        server, client, _url
    ):
        await measured_slow_service(server, client, gate, 0.001)
        held = asyncio.create_task(
            client.post("/v2/models/g/infer", json=infer_body(torch.ones(2)))
        )
        async with asyncio.timeout(WAIT_S):
            await gate.started.wait()
        late = await client.post(
            "/v2/models/g/infer", json=infer_body(torch.ones(2), parameters={"timeout": 50_000})
        )
        assert late.status_code == 504, late.text
        error = late.json()["error"]
        assert "50 ms timeout (parameters.timeout = 50000 us) while queued" in error
        assert "it never ran" in error
        assert gate.calls == 2
        gate.release.set()
        assert (await held).status_code == 200
        admission = server.served("g").admission
        assert admission.queued == 0 and admission.running == 0
        text = (await client.get("/metrics")).text
    # Triton counts a request that timed out in its scheduler's queue as REJECTED
    assert metric(text, "nv_inference_request_failure", model="g", reason="REJECTED") == 1
    assert metric(text, "nv_inference_request_failure", model="g", reason="CANCELED") == 0
    assert ex.statistics().completed == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_us", [1, 200])
async def test_a_deadline_that_passed_while_decoding_answers_504_without_running(
    linear: Any, monkeypatch: pytest.MonkeyPatch, timeout_us: int
) -> None:
    """Issue 37: a 64-row request with `parameters.timeout` 1 (microseconds, Triton's unit)
    got 200: its deadline passed while it was decoded, and an execution that runs straight
    through never reached the await where the timer fires. Decoding now takes 1 ms, past
    either timeout: 504 before anything runs, counted REJECTED as Triton counts a request
    that timed out before it ran. Without a timeout of its own it runs."""
    from asyncgraph.serve.codec import decode_request

    def slow_decode(*args: Any) -> Any:
        time.sleep(0.001)  # the decode outlasts the timeout, whatever the machine's speed
        return decode_request(*args)

    monkeypatch.setattr(app_module, "decode_request", slow_decode)
    _, ep = linear
    x = torch.randn(64, 4)
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (_, client, _url):
        late = await client.post(
            "/v2/models/lin/infer", json=infer_body(x, parameters={"timeout": timeout_us})
        )
        assert late.status_code == 504, late.text
        error = late.json()["error"]
        assert f"(parameters.timeout = {timeout_us} us) while it was read and decoded" in error
        assert error.endswith("it never ran")
        assert ex.statistics().completed == 0
        ok = await client.post("/v2/models/lin/infer", json=infer_body(x))
        assert ok.status_code == 200, ok.text
        assert ex.statistics().completed == 1
        text = (await client.get("/metrics")).text
    assert metric(text, "nv_inference_request_failure", model="lin", reason="REJECTED") == 1
    assert metric(text, "nv_inference_request_failure", model="lin", reason="CANCELED") == 0
    assert metric(text, "asyncgraph_requests_total", model="lin", code="504") == 1
    assert metric(text, "nv_inference_request_success", model="lin") == 1


def hold_the_loop(seconds: float) -> None:
    """Block the event loop, as a long stretch of work on it does."""
    time.sleep(seconds)


@pytest.mark.timeout(60)
async def test_a_deadline_that_passed_when_its_slot_came_answers_504_without_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request handed its slot after its deadline passed, before the deadline's timer
    could fire (the loop was busy until then: here the slot's hand-over blocks the loop past
    the deadline), is answered 504 without running."""
    calls: list[int] = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    async with asyncgraph.Executor(gated_graph(double)) as ex, serving({"g": ex}) as (
        server, client, _url
    ):
        admission = server.served("g").admission
        slot = admission.slot

        @asynccontextmanager
        async def late_slot(ticket: Any, remaining_s: float | None = None) -> Any:
            async with slot(ticket, remaining_s) as queue_s:
                assert remaining_s is not None and remaining_s > 0
                hold_the_loop(remaining_s + 0.001)  # until past the deadline
                yield queue_s

        monkeypatch.setattr(admission, "slot", late_slot)
        late = await client.post(
            "/v2/models/g/infer", json=infer_body(torch.ones(2), parameters={"timeout": 300_000})
        )
        assert late.status_code == 504, late.text
        error = late.json()["error"]
        assert "(parameters.timeout = 300000 us) while queued" in error
        assert error.endswith("it never ran")
        assert calls == [] and ex.statistics().completed == 0
        assert admission.running == 0 and admission.queued == 0
        text = (await client.get("/metrics")).text
    assert metric(text, "nv_inference_request_failure", model="g", reason="REJECTED") == 1


def charge_decodes(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, s_per_byte: float
) -> None:
    """Every request body decode (start-up calibration's included) costs `s_per_byte` fake
    seconds per body byte on the gate's clock: deterministic decode times, priced by size.
    HTTP's decode is app.py's; start-up calibration's is the server core's (core.py)."""
    decode = app_module.decode_request

    def costly_decode(body: bytes, *args: Any) -> Any:
        clock.now += s_per_byte * len(body)
        return decode(body, *args)

    monkeypatch.setattr(app_module, "decode_request", costly_decode)
    monkeypatch.setattr(core_module, "decode_request", costly_decode)


async def send_all_but_the_body(
    url: str, body: bytes, admission: Any, count: int
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """Open `count` requests that send their headers and a few bytes of `body`, one after
    another, each answered at the gate (admitted, or refused) before the next: admitted,
    they stay in flight (reading their bodies) until the test sends the rest."""
    host, port = url.removeprefix("http://").split(":")
    head = (b"POST /v2/models/lin/infer HTTP/1.1\r\nHost: test\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    opened = []
    for k in range(count):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body[:10])
        opened.append((reader, writer))
        await eventually(
            lambda k=k: admission.admitted + sum(admission.refused.values()) == k + 1,
            f"request {k} at the gate",
        )
    return opened


async def finish_bodies(
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]], body: bytes
) -> list[tuple[int, bytes]]:
    """Send the rest of each body; the responses, in order."""
    for _reader, writer in opened:
        writer.write(body[10:])
    answers = [await _read_response(reader) for reader, _writer in opened]
    for _reader, writer in opened:
        writer.close()
        await writer.wait_closed()
    return answers


@pytest.mark.timeout(60)
def assert_refused_then_served(
    refused: list[Any], answers: list[tuple[int, bytes]], metrics: str, want: torch.Tensor
) -> None:
    """Five requests refused for their deadline behind six 150 ms decodes; the six served."""
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "6 to decode at 150.0 ms each" in r.json()["error"], r.text
    for status, answer in answers:
        assert status == 200, answer
        got = torch.tensor(json.loads(answer)["outputs"][0]["data"]).reshape(1, 3)
        torch.testing.assert_close(got, want)
    assert metric(metrics, "asyncgraph_admission_refusals_total", model="lin",
                  reason="deadline") == 5


async def test_a_calibrated_server_answers_a_first_burst_that_fits_its_deadline(
    linear: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server times a representative request when it starts, so it predicts from the very
    first request. Here a decode costs 10 us per body byte (about 1.6 ms a request) and
    execution nothing, on the gate's clock, with one slot and a 1 s timeout: a first burst of
    20 requests, all in flight at once (still sending their bodies, so none has completed),
    expects at most 20 decodes (~32 ms) and is admitted in full, and every request is answered
    200. Uncalibrated, everything beyond the one slot got 503 ("nothing measured yet")."""
    model, ep = linear
    clock = FakeClock()
    charge_decodes(monkeypatch, clock, 1e-5)
    x = torch.randn(2, 4)
    body = json.dumps(infer_body(x)).encode()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    async with asyncgraph.Executor(ep, config) as ex, serving(
        {"lin": ex}, timeout_ms=1000, clock=clock, calibrate=True
    ) as (server, client, url):
        admission = server.served("lin").admission
        calibration = admission.calibration
        assert calibration is not None and admission.completed == 0
        assert calibration.decode_s_per_byte == pytest.approx(1e-5)
        assert calibration.execute_s == 0.0 and 1 <= calibration.rounds <= 5
        opened = await send_all_but_the_body(url, body, admission, 20)
        assert admission.queued == 20 and admission.refused["deadline"] == 0
        answers = await finish_bodies(opened, body)
        text = (await client.get("/metrics")).text
    with torch.no_grad():
        want = model(x)
    for status, answer in answers:
        assert status == 200, answer
        got = torch.tensor(json.loads(answer)["outputs"][0]["data"]).reshape(2, 3)
        torch.testing.assert_close(got, want)
    assert metric(text, "asyncgraph_calibrated", model="lin") == 1
    assert metric(text, "asyncgraph_decode_bytes_per_second", model="lin") == pytest.approx(1e5)
    assert metric(text, "asyncgraph_admission_refusals_total", model="lin", reason="deadline") == 0


@pytest.mark.timeout(60)
async def test_a_first_burst_beyond_the_calibrated_estimate_is_refused_at_once(
    linear: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calibrated at 150 ms of decode per request (and no execution time), with a 1 s timeout:
    6 requests of a first burst in flight (still sending their bodies) will hold the loop for
    0.9 s, so the next ones are refused (503) on arrival, while the 6 admitted have not even
    been read, nothing having completed; the admitted ones then succeed. Uncalibrated, the
    gate let in one request per slot (8) whatever they cost."""
    model, ep = linear
    clock = FakeClock()
    x = torch.randn(1, 4)
    body = json.dumps(infer_body(x)).encode()
    charge_decodes(monkeypatch, clock, 0.15 / len(body))
    async with asyncgraph.Executor(ep) as ex, serving(
        {"lin": ex}, timeout_ms=1000, clock=clock, calibrate=True
    ) as (server, client, url):
        admission = server.served("lin").admission
        assert admission.calibration is not None
        opened = await send_all_but_the_body(url, body, admission, 6)
        refused = await asyncio.gather(
            *(client.post("/v2/models/lin/infer", content=body) for _ in range(5))
        )
        still_reading = admission.queued
        assert admission.completed == 0
        answers = await finish_bodies(opened, body)
        text = (await client.get("/metrics")).text
    assert still_reading == 6  # the refusals came first
    assert_refused_then_served(refused, answers, text, model(x).detach())


class FailsFirst(Gate):
    """A Gate whose first call raises: the model fails start-up calibration."""

    async def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls == 0:
            self.calls += 1
            raise RuntimeError("not on random inputs")
        return await super().__call__(x)


@pytest.mark.timeout(60)
async def test_a_server_whose_calibration_fails_refuses_a_first_burst_beyond_the_slots(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model that fails on the calibration's random inputs is left uncalibrated, and the
    server says why, once: with nothing measured it cannot promise a deadline to a request
    that would queue, so with its one slot held a burst with a 2 s timeout is refused (503) at
    once instead of being admitted blindly to miss its deadline (504 after 2 s). Once a
    request has completed, the gate judges by what it measured."""
    gate = FailsFirst()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    caplog.set_level("WARNING", logger="asyncgraph.serve")
    async with asyncgraph.Executor(gated_graph(gate), config) as ex, serving(
        {"g": ex}, timeout_ms=2000, calibrate=True
    ) as (server, client, _url):
        admission = server.served("g").admission
        assert admission.calibration is None and not admission.measured
        body = infer_body(torch.ones(2))
        held = asyncio.create_task(client.post("/v2/models/g/infer", json=body))
        async with asyncio.timeout(WAIT_S):
            await gate.started.wait()
        burst = await asyncio.gather(
            *(client.post("/v2/models/g/infer", json=body) for _ in range(5))
        )
        calls = gate.calls
        gate.release.set()
        assert (await held).status_code == 200
        after = await client.post("/v2/models/g/infer", json=body)
        text = (await client.get("/metrics")).text
    warnings = [r.getMessage() for r in caplog.records if "not calibrated" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "model 'g'" in warnings[0] and "RuntimeError: not on random inputs" in warnings[0]
    assert calls == 2  # calibration's and the held one: no refused request ran
    for r in burst:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "nothing measured yet" in r.json()["error"], r.text
    assert after.status_code == 200
    assert metric(text, "asyncgraph_calibrated", model="g") == 0
    assert metric(text, "asyncgraph_admission_refusals_total", model="g", reason="deadline") == 5
    assert ex.statistics().completed == 2


class Counter(torch.nn.Module):
    """Counts its calls in a buffer: state that calibration must not touch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x + self.calls


@pytest.mark.timeout(60)
async def test_a_program_that_mutates_its_buffers_is_not_executed_to_calibrate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Calibration would run the program on made-up inputs: a stateful one (here a call
    counter) is left uncalibrated, with the reason logged, and its first request sees the
    state it was loaded with."""
    ep = torch.export.export(Counter(), (torch.zeros(2),))
    caplog.set_level("WARNING", logger="asyncgraph.serve")
    async with asyncgraph.Executor(ep) as ex, serving(
        {"c": ex}, timeout_ms=2000, calibrate=True
    ) as (server, client, _url):
        assert server.served("c").admission.calibration is None
        first = await client.post("/v2/models/c/infer", json=infer_body(torch.zeros(2)))
    assert first.status_code == 200, first.text
    assert first.json()["outputs"][0]["data"] == [1.0, 1.0]  # the first call, not the seventh
    warnings = [r.getMessage() for r in caplog.records if "not calibrated" in r.getMessage()]
    assert len(warnings) == 1 and "mutates its buffers (calls)" in warnings[0], warnings
    assert ex.statistics().completed == 1


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length: its status and body."""
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


@pytest.mark.timeout(60)
async def test_a_decode_bound_overload_is_refused_before_the_admitted_requests_finish(
    linear: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's decode-bound model: a request's cost is its JSON decode on the event loop,
    not its execution. Here each decode costs 150 ms on the gate's clock and execution none;
    with a 1 s timeout, 6 requests admitted and still sending their bodies will hold the loop
    for 0.9 s, so the next ones are refused (503) on arrival, answered while the admitted
    ones ahead of them have not even been read. The admitted ones then succeed."""
    model, ep = linear
    clock = FakeClock()
    decode = app_module.decode_request

    def costly_decode(*args: Any) -> Any:
        clock.now += 0.15
        return decode(*args)

    monkeypatch.setattr(app_module, "decode_request", costly_decode)
    x = torch.randn(1, 4)
    body = json.dumps(infer_body(x)).encode()
    head = (b"POST /v2/models/lin/infer HTTP/1.1\r\nHost: test\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    async with asyncgraph.Executor(ep) as ex, serving(
        {"lin": ex}, timeout_ms=1000
    ) as (server, client, url):
        admission = server.served("lin").admission
        admission.clock = clock
        assert (await client.post("/v2/models/lin/infer", content=body)).status_code == 200
        assert admission.mean_decode_s == 0.15 and admission.mean_service_s == 0.0
        host, port = url.removeprefix("http://").split(":")
        admitted = []
        for k in range(6):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(head + body[:10])
            admitted.append((reader, writer))
            await eventually(lambda k=k: admission.queued == k + 1, f"request {k} admitted")
        refused = await asyncio.gather(
            *(client.post("/v2/models/lin/infer", content=body) for _ in range(5))
        )
        still_reading = admission.queued
        for _reader, writer in admitted:
            writer.write(body[10:])
        answers = [await _read_response(reader) for reader, _writer in admitted]
        for _reader, writer in admitted:
            writer.close()
            await writer.wait_closed()
        text = (await client.get("/metrics")).text
    assert still_reading == 6  # the refusals came first
    assert_refused_then_served(refused, answers, text, model(x).detach())
    assert ex.statistics().completed == 7


def test_tritonclient_timeout_parameter_reaches_the_server() -> None:
    """tritonclient's infer(timeout=us) sends Triton's parameters.timeout, which we read."""
    from asyncgraph.serve.codec import request_timeout_s

    request, _ = th.InferenceServerClient.generate_request_body(
        [_triton_input()], timeout=250_000
    )
    doc = json.loads(request)
    assert request_timeout_s(doc["parameters"]) == 0.25


def _triton_input() -> Any:
    x = th.InferInput("x", [2], "FP32")
    x.set_data_from_numpy(np.ones(2, dtype=np.float32), binary_data=False)
    return x


@pytest.mark.timeout(60)
async def test_the_memory_cap_refuses_at_its_bound() -> None:
    """--max-queue-bytes: one request runs, one waits holding its body's bytes; the next body
    would pass the cap and is refused as it arrives (bytes are charged as they arrive, not as
    declared: issue 39)."""
    gate = Gate()
    config = asyncgraph.ExecutorConfig(max_concurrent_executions=1)
    body = json.dumps(infer_body(torch.ones(2))).encode()
    async with asyncgraph.Executor(gated_graph(gate), config) as ex, serving(
        {"g": ex}, max_queue_bytes=len(body) + len(body) // 2
    ) as (server, client, _url):
        held = asyncio.create_task(client.post("/v2/models/g/infer", content=body))
        async with asyncio.timeout(WAIT_S):
            await gate.started.wait()
        waiting = asyncio.create_task(client.post("/v2/models/g/infer", content=body))
        admission = server.served("g").admission
        await eventually(lambda: admission.statistics().queued_bytes == len(body),
                         "the second request waits, charged its body")
        assert admission.queued == 1
        refused = await client.post("/v2/models/g/infer", content=body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "--max-queue-bytes" in refused.json()["error"]
        assert gate.calls == 1
        text = (await client.get("/metrics")).text
        gate.release.set()
        assert [(await t).status_code for t in (held, waiting)] == [200, 200]
    assert metric(text, "asyncgraph_queued_bytes", model="g") == len(body)
    refusals = {reason: metric(text, "asyncgraph_admission_refusals_total", model="g",
                               reason=reason)
                for reason in ("deadline", "max_queue", "max_queue_bytes")}
    assert refusals == {"deadline": 0, "max_queue": 0, "max_queue_bytes": 1}
    assert ex.statistics().completed == 2


@pytest.mark.timeout(60)
async def test_a_full_batcher_queue_answers_503(linear: Any) -> None:
    """The admission gate lets frames x max_batch_size requests in; a batcher queue bounded
    below that refuses the rest with OverloadedError, which the server answers with 503."""
    _, ep = linear
    faults = FaultInjector()
    gate = faults.block("linear")
    config = asyncgraph.ExecutorConfig(
        max_concurrent_executions=1, heavy_op_flops=0, adaptive_placement=False,
        batching=asyncgraph.BatchingConfig(
            max_batch_size=4, max_concurrent_batches=1, max_queued_requests=2
        ),
    )
    ex = asyncgraph.Executor(ep, config, kernel_factory=faults.kernel_factory())
    body = infer_body(torch.ones(1, 4))
    async with ex, serving({"lin": ex}) as (_, client, _url):
        try:
            first = asyncio.create_task(client.post("/v2/models/lin/infer", json=body))
            await gate.wait_entered(1)
            queued = [asyncio.create_task(client.post("/v2/models/lin/infer", json=body))
                      for _ in range(2)]
            await eventually(
                lambda: getattr(ex.batching_statistics(), "queued", 0) == 2, "2 queued"
            )
            refused = await client.post("/v2/models/lin/infer", json=body)
        finally:
            gate.open()
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "BatchingConfig.max_queued_requests=2" in refused.json()["error"]
        assert [r.status_code for r in await asyncio.gather(first, *queued)] == [200] * 3
        text = (await client.get("/metrics")).text
    assert metric(text, "nv_inference_request_failure", model="lin", reason="REJECTED") == 1


async def test_timeout_cancels_a_slow_execution() -> None:
    gate = Gate()
    async with asyncgraph.Executor(gated_graph(gate)) as ex, serving(
        {"g": ex}, timeout_ms=50
    ) as (_, client, _url):
        r = await client.post("/v2/models/g/infer", json=infer_body(torch.ones(2)))
        assert r.status_code == 504
        error = r.json()["error"]
        assert "50 ms timeout" in error and "while running" in error and "cancelled" in error
        assert gate.cancelled == 1
        stats = ex.statistics()
        assert stats.cancelled == 1 and stats.frames.in_use == 0
        text = (await client.get("/metrics")).text
    assert metric(text, "nv_inference_request_failure", model="g", reason="CANCELED") == 1
    assert metric(text, "nv_inference_request_failure", model="g", reason="REJECTED") == 0


async def test_nonfinite_outputs_are_json_that_strict_parsers_read() -> None:
    """Issue 37: `"data":[NaN]` is not JSON (JavaScript's JSON.parse and Go's encoding/json
    refuse it). NaN and the infinities travel as the strings "NaN", "Infinity", "-Infinity"
    (docs/serving.md), are accepted back as input data, and binary data is raw bytes."""

    def strict(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    async with asyncgraph.Executor(gated_graph(torch.log)) as ex, serving({"g": ex}) as (
        _, client, _url
    ):
        r = await client.post("/v2/models/g/infer", json=infer_body(torch.tensor([-1.0, 0.0])))
        assert r.status_code == 200, r.text
        [out] = json.loads(r.text, parse_constant=strict)["outputs"]
        assert out["data"] == ["NaN", "-Infinity"]
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2],
                            "data": ["Infinity", "NaN"]}]}
        r = await client.post("/v2/models/g/infer", json=body)
        assert r.status_code == 200, r.text
        assert json.loads(r.text, parse_constant=strict)["outputs"][0]["data"] == [
            "Infinity", "NaN"
        ]
        body["outputs"] = [{"name": "output_0", "parameters": {"binary_data": True}}]
        r = await client.post("/v2/models/g/infer", json=body)
        n = int(r.headers["Inference-Header-Content-Length"])
        got = np.frombuffer(r.content[n:], dtype=np.float32)
        assert got[0] == np.inf and np.isnan(got[1])
        assert ex.statistics().completed == 3


async def test_kernel_error_is_500_naming_the_node() -> None:
    def explode(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    async with asyncgraph.Executor(gated_graph(explode)) as ex, serving({"g": ex}) as (
        _, client, _url
    ):
        r = await client.post("/v2/models/g/infer", json=infer_body(torch.ones(2)))
    assert r.status_code == 500
    assert r.json()["error"].startswith("model 'g': ValueError: boom (While executing %gate")


async def test_closed_executor_is_not_ready_and_answers_503(linear: Any) -> None:
    _, ep = linear
    ex = asyncgraph.Executor(ep)
    async with serving({"lin": ex}) as (_, client, _url):
        await ex.aclose()
        for path in ("/v2/models/lin/ready", "/v2/health/ready"):
            r = await client.get(path)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["ready"] is False
        r = await client.post("/v2/models/lin/infer", json=infer_body(torch.ones(1, 4)))
        assert r.status_code == 503 and "closed" in r.json()["error"]
        assert r.headers["retry-after"] == "1"


# -- malformed requests ----------------------------------------------------------------------


def _binary(
    doc: dict[str, Any], blob: bytes, header: str | None = None
) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(doc).encode()
    return head + blob, {"Inference-Header-Content-Length": header or str(len(head))}


def _json(doc: Any) -> tuple[bytes, dict[str, str]]:
    return json.dumps(doc).encode(), {"content-type": "application/json"}


def _x(**changes: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}
    entry.update(changes)
    return {"inputs": [{k: v for k, v in entry.items() if v is not None}]}


MALFORMED: dict[str, tuple[tuple[bytes, dict[str, str]], str]] = {
    "bad json": ((b'{"inputs": [', {}), "request body: not valid JSON"),
    "not an object": (_json([1, 2]), "request body: expected a JSON object, got a list"),
    "no inputs": (_json({}), "inputs: expected a list of tensors, got null"),
    "unknown input": (
        _json(_x(name="y")),
        "inputs[0].name: unknown input 'y'; model 'lin' expects 'x'"),
    "missing input": (_json({"inputs": []}), "inputs: missing input(s) 'x' (FP32 [-1, 4])"),
    "duplicate input": (
        _json({"inputs": _x()["inputs"] * 2}),
        "inputs[1].name: input 'x' given twice"),
    "wrong datatype": (
        _json(_x(datatype="FP64")),
        "inputs[0] ('x').datatype: expected 'FP32', got 'FP64'"),
    "unsupported datatype": (
        _json(_x(datatype="BYTES")),
        "inputs[0] ('x').datatype: expected 'FP32', got 'BYTES'"),
    "wrong rank": (
        _json(_x(shape=[4])),
        "inputs[0] ('x').shape: expected 2 dimension(s) [-1, 4], got 1 [4]"),
    "wrong dimension": (
        _json(_x(shape=[1, 5], data=[1.0] * 5)),
        "inputs[0] ('x').shape[1]: expected 4, got 5"),
    "dimension out of range": (
        _json(_x(shape=[65, 4], data=[0.0] * 260)),
        "inputs[0] ('x').shape[0]: expected a size in [1, 64], got 65"),
    "negative dimension": (
        _json(_x(shape=[-1, 4])),
        "inputs[0] ('x').shape[0]: expected an integer in [0, 9223372036854775807], got -1"),
    "huge shape": (
        _json(_x(shape=[10**15, 4])),
        "inputs[0] ('x').shape[0]: expected a size in [1, 64], got 1000000000000000"),
    "data length": (
        _json(_x(data=[1.0] * 3)),
        "inputs[0] ('x').data: expected 4 element(s) for shape [1, 4], got 3"),
    "data element": (
        _json(_x(data=[1.0, "a", 2.0, 3.0])),
        "inputs[0] ('x').data[1]: expected a number (or \"NaN\", \"Infinity\", "
        "\"-Infinity\"), got 'a'"),
    "no data": (_json(_x(data=None)), "inputs[0] ('x').data: missing"),
    "bad timeout": (
        _json({**_x(), "parameters": {"timeout": 1.5}}),
        "parameters.timeout: expected an integer number of microseconds in [0, "
        "18446744073709551615], got 1.5"),
    # issue 39: each of these was a 500 counted as a BACKEND failure
    "nested 1000 deep": (
        (b'{"inputs": ' + b"[" * 1000 + b"]" * 1000 + b"}", {}),
        "request body: JSON nested too deeply"),
    "integer beyond float range": (
        _json(_x(data=[10**310, 1.0, 1.0, 1.0])),
        "inputs[0] ('x').data[0]: 1000000000"),
    "timeout beyond uint64": (
        _json({**_x(), "parameters": {"timeout": 10**400}}),
        "parameters.timeout: expected an integer number of microseconds in [0, "
        "18446744073709551615], got 1000000000"),
    "dimension of 4300 digits": (
        _json(_x(shape=[10**4299, 4])),
        "inputs[0] ('x').shape[0]: expected an integer in [0, 9223372036854775807], got a "
        "3571-hex-digit integer"),
    "output requested twice": (
        _json({**_x(), "outputs": [{"name": "output_0"}, {"name": "output_0"}]}),
        "outputs[1].name: output 'output_0' requested twice (also outputs[0])"),
    "unknown output": (
        _json({**_x(), "outputs": [{"name": "z"}]}),
        "outputs[0].name: unknown output 'z'"),
    "binary header not a number": (
        _binary(_x(data=None, parameters={"binary_data_size": 16}), b"\0" * 16, "ten"),
        "Inference-Header-Content-Length header: expected an integer, got 'ten'"),
    "binary header too long": (
        _binary(_x(data=None, parameters={"binary_data_size": 16}), b"\0" * 16, "100000"),
        "Inference-Header-Content-Length header: expected a length in [1, "),
    "binary size mismatch": (
        _binary(_x(data=None, parameters={"binary_data_size": 12}), b"\0" * 12),
        "inputs[0] ('x').parameters.binary_data_size: expected 16 bytes for FP32 [1, 4], got 12"),
    "binary data short": (
        _binary(_x(data=None, parameters={"binary_data_size": 16}), b"\0" * 15),
        "binary data: the inputs declare 16 bytes, the body carries 15"),
    "binary size without header": (
        _json(_x(data=None, parameters={"binary_data_size": 16})),
        "parameters.binary_data_size: set, but the request has no binary data"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_request_gets_400_naming_the_field(linear: Any, case: str) -> None:
    (body, headers), message = MALFORMED[case]
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (_, client, _url):
        r = await client.post("/v2/models/lin/infer", content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]
        assert ex.statistics().started == 0  # no frame taken, no kernel reached
        text = (await client.get("/metrics")).text
    assert metric(text, "nv_inference_request_failure", model="lin", reason="OTHER") == 1
    assert metric(text, "nv_inference_request_failure", model="lin", reason="BACKEND") == 0


async def test_request_size_limit_and_compressed_bodies(linear: Any) -> None:
    model, ep = linear
    x = torch.randn(2, 4)
    body = json.dumps(infer_body(x)).encode()
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}, max_request_bytes=512) as (
        _, client, _url
    ):
        big = json.dumps(infer_body(torch.randn(64, 4))).encode()
        assert len(big) > 512
        r = await client.post("/v2/models/lin/infer", content=big)
        assert r.status_code == 413 and "exceeds the limit of 512 bytes" in r.json()["error"]
        r = await client.post(
            "/v2/models/lin/infer", content=gzip.compress(body),
            headers={"content-encoding": "gzip"},
        )
        assert r.status_code == 200, r.text
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(
            torch.tensor(r.json()["outputs"][0]["data"]).reshape(2, 3), expected
        )
        bomb = gzip.compress(b" " * 100_000)
        r = await client.post(
            "/v2/models/lin/infer", content=bomb, headers={"content-encoding": "gzip"}
        )
        assert r.status_code == 413 and "inflates past the limit" in r.json()["error"]
        assert ex.statistics().started == 1


async def test_a_large_compressed_body_inflates_off_the_loop(
    linear: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that inflates to 400 KB is inflated on a thread (after an inline try); a small
    one inline (a thread hop costs more than inflating it)."""
    model, ep = linear
    x = torch.randn(2, 4)
    small = json.dumps(infer_body(x)).encode()
    large = small + b" " * 400_000  # JSON allows trailing whitespace
    real = zlib.decompressobj
    inflated_on: list[int] = []

    class RecordingInflater:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inflater = real(*args, **kwargs)

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            inflated_on.append(threading.get_ident())
            return self.inflater.decompress(data, max_length)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inflater, name)

    monkeypatch.setattr(zlib, "decompressobj", RecordingInflater)
    loop_thread = threading.get_ident()
    with torch.no_grad():
        expected = model(x)
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (_, client, _url):
        threads = []
        for body in (small, large):
            inflated_on.clear()
            r = await client.post("/v2/models/lin/infer", content=gzip.compress(body),
                                  headers={"content-encoding": "gzip"})
            assert r.status_code == 200, r.text
            got = torch.tensor(r.json()["outputs"][0]["data"]).reshape(2, 3)
            torch.testing.assert_close(got, expected)
            threads.append({t != loop_thread for t in inflated_on})
    assert threads == [{False}, {False, True}]  # small: inline; large: inline, then a thread


@pytest.mark.parametrize("size", [0, 1, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, 100_000])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_inflation_at_the_inline_part_and_the_limit(size: int, encoding: str) -> None:
    from asyncgraph.serve.app import decompress

    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    packed = gzip.compress(data) if encoding == "gzip" else zlib.compress(data)
    assert await decompress(packed, encoding, limit=100_000) == data
    if size:
        with pytest.raises(ProtocolError, match="inflates past the limit") as info:
            await decompress(packed, encoding, limit=size - 1)
        assert info.value.status == 413
        with pytest.raises(ProtocolError, match="truncated"):
            await decompress(packed[:-8], encoding, limit=100_000)


# -- embedding -------------------------------------------------------------------------------


async def test_mounted_in_a_parent_app_that_owns_the_executor(linear: Any) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    model, ep = linear
    models: dict[str, asyncgraph.Executor] = {}

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with asyncgraph.Executor(ep) as ex:
            models["lin"] = ex
            yield
            models.clear()

    parent = Starlette(routes=[Mount("/kserve", create_app(models))], lifespan=lifespan)
    x = torch.randn(1, 4)
    async with running_server(parent) as url, httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/kserve/v2/models/lin")).status_code == 200
        r = await client.post("/kserve/v2/models/lin/infer", json=infer_body(x))
        assert r.status_code == 200, r.text
        ex = models["lin"]
        assert ex.statistics().completed == 1
    assert models == {} and ex.statistics().closed
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(torch.tensor(r.json()["outputs"][0]["data"]).reshape(1, 3), expected)


async def test_metrics_use_triton_names(linear: Any) -> None:
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex, serving({"lin": ex}) as (_, client, _url):
        await client.post("/v2/models/lin/infer", json=infer_body(torch.ones(1, 4)))
        await client.post("/v2/models/lin/infer", json={"inputs": []})
        r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert "# TYPE nv_inference_request_success counter" in text
    assert metric(text, "nv_inference_request_success", model="lin", version="1") == 1
    assert metric(text, "nv_inference_request_failure", model="lin", reason="OTHER") == 1
    assert metric(text, "nv_inference_count", model="lin") == 1
    assert metric(text, "nv_inference_compute_infer_duration_us", model="lin") > 0
    assert metric(text, "nv_inference_pending_request_count", model="lin") == 0
    assert metric(text, "asyncgraph_frames_in_use", model="lin") == 0
    assert metric(text, "asyncgraph_frame_waiters", model="lin") == 0
    assert metric(text, "asyncgraph_requests_total", model="lin", code="400") == 1


def test_every_metric_is_documented() -> None:
    """docs/serving.md names every metric metrics.py exposes (a new one must be documented)."""
    from pathlib import Path

    import asyncgraph.serve.metrics as metrics_module

    source = Path(metrics_module.__file__).read_text()
    names = set(re.findall(r'"((?:nv_inference|asyncgraph)_[a-z_]+)"', source))
    assert len(names) >= 20  # the pattern still finds them
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in docs)
    assert not missing, f"metrics missing from docs/serving.md: {missing}"


async def test_a_server_that_owns_its_process_freezes_its_heap_before_traffic(
        linear: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """freeze_heap=True (what `asyncgraph serve` passes): once the lifespan has started, what
    was alive is in the collector's permanent generation, so a full collection during
    serving walks only what serving made; False (the default for a mounted app) leaves the
    user's heap alone."""
    import gc

    freezes: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))  # the suite's own freezes
    _, ep = linear
    async with asyncgraph.Executor(ep) as ex:
        async with serving({"lin": ex}) as (_, client, _url):
            assert (await client.get("/v2/health/ready")).status_code == 200
        assert freezes == []
        async with serving({"lin": ex}, freeze_heap=True) as (_, client, _url):
            assert (await client.get("/v2/health/ready")).status_code == 200
            assert freezes == [1]
