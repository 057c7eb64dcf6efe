"""asyncgraph.ray on a local Ray instance (127.0.0.1, 2 logical CPUs): replicas behind Serve.

One Ray instance and one Serve application (2 replicas, two models) are shared by the module:
Ray and Serve take seconds to start. The tests run in file order; the last one deletes the app
while requests are in flight (the drain). The executors live in the replica processes, so the
replicas' own leak check is their /metrics after the traffic: no frame in use, no request held.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve")
serve_api = pytest.importorskip("ray.serve._private.api")  # HTTP_PROXY_TIMEOUT (the fixture)

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from asyncgraph.errors import ProgramLoadError  # noqa: E402
from asyncgraph.ray import ModelReplica, ModelSource, build_app  # noqa: E402
from asyncgraph.ray.proxy import (  # noqa: E402
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    REPLICA_LOST_HEADER,
    ReplicaLostMiddleware,
)
from asyncgraph.runtime.config import ExecutorConfig  # noqa: E402

# one module-scoped Ray instance: one xdist worker starts it for every test here
pytestmark = pytest.mark.xdist_group("ray")

APP = "ag"
WAIT_S = 60.0


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Slow(torch.nn.Module):
    """~20-50 ms a request on one thread: long enough to be caught in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(256, 256) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.expand(192, 256)
        for _ in range(24):
            h = torch.tanh(h @ self.weight)
        return h.sum(dim=0, keepdim=True)[:, :4]


def _export(module: torch.nn.Module, example: torch.Tensor, path: Path, dynamic: bool) -> None:
    shapes = ({0: torch.export.Dim("batch", min=1, max=64)},) if dynamic else None
    torch.export.save(torch.export.export(module, (example,), dynamic_shapes=shapes), path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ray-models")
    affine, slow = Affine().eval(), Slow().eval()
    _export(affine, torch.randn(2, 4), root / "affine.pt2", dynamic=True)
    _export(slow, torch.randn(1, 256), root / "slow.pt2", dynamic=False)
    return {"affine": affine, "slow": slow, "dir": root}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def cluster(models: dict[str, Any]) -> Iterator[str]:
    """A local Ray instance, Serve's proxy on 127.0.0.1 and the shared 2-replica app."""
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # the proxy inherits it from this process
    # Serve kills a proxy that misses its ready (5 s) or health (10 s) checks: on a saturated
    # 2-core machine it did, and every test of the module errored. The tests are not about that.
    for check in ("READY_CHECK", "HEALTH_CHECK"):
        os.environ.setdefault(f"RAY_SERVE_PROXY_{check}_TIMEOUT_S", "120")
    # serve.start waits for the proxy HTTP_PROXY_TIMEOUT (60 s), a constant with no setting:
    # under a CPU burner the proxy took longer and every test of the module errored ("HTTP
    # proxies not available after 60s"). The wait is read from the api module at call time.
    if hasattr(serve_api, "HTTP_PROXY_TIMEOUT"):
        serve_api.HTTP_PROXY_TIMEOUT = max(serve_api.HTTP_PROXY_TIMEOUT, 300)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _deploy_shared_app(models)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop(PROXY_CALLBACK_ENV, None)


def _deploy_shared_app(models: dict[str, Any]) -> None:
    """The module's 2-replica app of the affine and slow models, at route `/`."""
    app = build_app(
        {"affine": models["dir"] / "affine.pt2", "slow": models["dir"] / "slow.pt2"},
        num_replicas=2,
        executor_config=ExecutorConfig(max_concurrent_executions=2, intra_op_threads=1),
        ray_actor_options={"num_cpus": 0.5},
        metrics_interval_s=None,
        graceful_shutdown_wait_loop_s=0.5,
    )
    serve.run(app, name=APP, route_prefix="/")


def affine_body(x: torch.Tensor) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.reshape(-1).tolist()}]}


def expected(models: dict[str, Any], name: str, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        out: np.ndarray = models[name](x).numpy()
        return out


def correct(models: dict[str, Any], name: str, x: torch.Tensor, response: httpx.Response) -> bool:
    data = np.array(response.json()["outputs"][0]["data"], dtype=np.float32)
    return bool(np.allclose(data, expected(models, name, x).reshape(-1), rtol=1e-4, atol=1e-5))


def replica_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#")}


def running_replicas() -> int:
    status = serve.status().applications[APP].deployments["asyncgraph"]
    return int(status.replica_states.get("RUNNING", 0))


def _replaced(killed: str) -> bool:
    names = replica_names()
    return killed not in names and len(names) == 2 and running_replicas() == 2


def metric_values(text: str, name: str) -> list[float]:
    pattern = re.compile(rf"{name}(\{{[^}}]*\}})? (\S+)")
    return [float(m.group(2)) for line in text.splitlines() if (m := pattern.fullmatch(line))]


# -- the proxy middleware, without Ray ----------------------------------------------------------


@pytest.mark.parametrize("sent", ["nothing", "start only"])
async def test_a_request_that_ends_with_no_response_gets_503_with_retry_after(sent: str) -> None:
    """What Serve's proxy does when the replica holding a request dies: its app returns without
    a response (uvicorn would answer 500), or, when the replica died between the batch carrying
    its response's start and the one carrying its body, with only the start sent (the client
    got headers and a closed connection: CI, 2026-11-27). The middleware answers a retryable
    503 in both cases."""

    async def lost(scope: Any, receive: Any, send: Any) -> None:
        if sent == "start only":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"190")]})

    middleware = ReplicaLostMiddleware(lost)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post("/v2/models/m/infer", json={})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.headers[REPLICA_LOST_HEADER] == "1"
    assert "POST /v2/models/m/infer" in r.json()["error"]
    assert middleware.statistics() == {"replica_lost": 1, "body_lost": int(sent == "start only")}


async def test_a_streamed_response_passes_through_chunk_by_chunk() -> None:
    """The start is held only until the first body message: a streamed body is not buffered
    (the client has the start and the first chunk before the app sends the second)."""
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def streamed(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert sent == []  # held
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        await send({"type": "http.response.body", "body": b"b"})

    middleware = ReplicaLostMiddleware(streamed)
    await middleware({"type": "http", "method": "GET", "path": "/s"}, receive, send)
    assert [m.get("body") for m in sent] == [None, b"a", b"b"]
    assert middleware.statistics() == {"replica_lost": 0, "body_lost": 0}


async def test_responses_that_started_pass_through_untouched() -> None:
    async def kernel_error(request: Any) -> Response:
        return JSONResponse({"error": "node 'mm' failed"}, 500)

    inner = Starlette(routes=[Route("/x", kernel_error, methods=["POST"])])
    middleware = ReplicaLostMiddleware(inner)
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post("/x")
    assert (r.status_code, r.json()) == (500, {"error": "node 'mm' failed"})
    assert REPLICA_LOST_HEADER not in r.headers
    assert middleware.statistics() == {"replica_lost": 0, "body_lost": 0}


# -- the replica, without Ray -------------------------------------------------------------------


def test_replica_refuses_a_pt2_that_fails_the_archive_checks(
    models: dict[str, Any], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.pt2"
    data = bytearray((models["dir"] / "affine.pt2").read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\0" * 64  # a corrupt member
    bad.write_bytes(bytes(data))
    with pytest.raises(ProgramLoadError, match=r"bad\.pt2"):
        ModelReplica({"bad": ModelSource.shared(bad)}, ExecutorConfig(), {}, False, None)


def test_build_app_refuses_replicas_and_autoscaling_together(models: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="num_replicas or autoscaling_config"):
        build_app({"a": models["dir"] / "affine.pt2"}, num_replicas=2,
                  autoscaling_config={"min_replicas": 1, "max_replicas": 2})


# -- on Ray ---------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_tritonclient_json_and_binary_through_the_proxy(
    cluster: str, models: dict[str, Any]
) -> None:
    import tritonclient.http as th

    assert running_replicas() == 2
    client = th.InferenceServerClient(cluster.removeprefix("http://"))
    assert client.is_server_ready()
    assert client.get_model_metadata("affine")["inputs"][0]["shape"] == [-1, 4]
    x = torch.randn(5, 4)
    for binary in (False, True):
        inp = th.InferInput("x", [5, 4], "FP32")
        inp.set_data_from_numpy(x.numpy(), binary_data=binary)
        out = th.InferRequestedOutput("output_0", binary_data=binary)
        result = client.infer("affine", [inp], outputs=[out])
        np.testing.assert_allclose(result.as_numpy("output_0"), expected(models, "affine", x),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(240)
async def test_200_concurrent_requests_are_all_correct(
    cluster: str, models: dict[str, Any]
) -> None:
    xs = [torch.randn(1 + i % 7, 4) for i in range(200)]
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=cluster, timeout=WAIT_S, limits=limits) as client:
        responses = await asyncio.gather(
            *(client.post("/v2/models/affine/infer", json=affine_body(x)) for x in xs)
        )
        assert [r.status_code for r in responses] == [200] * 200
        assert all(correct(models, "affine", x, r) for x, r in zip(xs, responses, strict=True))
        # each replica's own leak check: nothing held once the traffic is over (the proxy
        # picks a replica per scrape; 8 scrapes reach both with probability 1 - 2^-7)
        for _ in range(8):
            text = (await client.get("/metrics")).text
            assert metric_values(text, "asyncgraph_frames_in_use") == [0.0, 0.0]
            assert metric_values(text, "asyncgraph_running_requests") == [0.0, 0.0]


@pytest.mark.timeout(240)
def test_a_shipped_model_reaches_the_replica_through_the_object_store(
    cluster: str, models: dict[str, Any], tmp_path: Path
) -> None:
    """The driver's file is gone before the replica starts: only the object store has it."""
    path = tmp_path / "only-here.pt2"
    path.write_bytes((models["dir"] / "affine.pt2").read_bytes())
    source = ModelSource.shipped(path)
    path.unlink()
    handle = serve.run(
        build_app({"shipped": source}, metrics_interval_s=None), name="shipped",
        route_prefix="/shipped",
    )
    try:
        assert handle is not None
        r = httpx.get(f"{cluster}/shipped/v2/models/shipped", timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert r.json()["inputs"][0]["shape"] == [-1, 4]
    finally:
        serve.delete("shipped")


@pytest.mark.timeout(240)
def test_a_replica_refuses_a_corrupt_shipped_model(
    cluster: str, models: dict[str, Any], tmp_path: Path
) -> None:
    bad = tmp_path / "corrupt.pt2"
    data = bytearray((models["dir"] / "affine.pt2").read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\0" * 64
    bad.write_bytes(bytes(data))
    app = build_app({"bad": ModelSource.shipped(bad)}, metrics_interval_s=None,
                    max_constructor_retry_count=1)
    try:
        with pytest.raises(RuntimeError, match="Deploying application bad failed"):
            serve.run(app, name="bad", route_prefix="/bad")
        message = serve.status().applications["bad"].deployments["asyncgraph"].message
        assert re.search(r"ProgramLoadError: .*corrupt\.pt2 \(shipped through the object "
                         r"store\)", message), message
    finally:
        serve.delete("bad")


@pytest.mark.timeout(300)
def test_a_replica_killed_under_load_fails_only_its_requests_with_503(
    cluster: str, models: dict[str, Any]
) -> None:
    """ray.kill on a replica actor mid-traffic: the requests it held get 503 + Retry-After
    (the proxy middleware), every other request is correct, traffic goes on, and Serve starts a
    replacement. (A sync test: it runs once, not once per event loop.)

    Ray Serve 2.60's router can strand a request it retries after the dead replica refused it:
    in 1 of 22 runs of this test in the machine's Ray logs (2026-11-25; 17 requests retried
    after a kill, 16 answered 200 within 0.35 s) the proxy logged "will not be considered for
    future requests because it has died" for one request, went on routing every other request,
    and answered that one only when its client gave up 60 s later (499). asyncgraph never sees
    such a request (it is in the proxy's router, no replica got it), so the test gives each
    request a client timeout and allows requests stranded so only among those sent before the
    kill returned (in flight when it happened: two of the 8 in one run on 2026-11-29), fewer
    than the clients (docs/scale-out.md says what a client should do)."""
    asyncio.run(_kill_under_load(cluster, models))


STRANDED_TIMEOUT_S = 30.0


async def _kill_under_load(cluster: str, models: dict[str, Any]) -> None:
    before = replica_names()
    assert len(before) == 2
    results: list[tuple[torch.Tensor, httpx.Response]] = []
    stranded: list[float] = []  # when each request Serve's router never answered was sent
    stop = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            x = torch.randn(1, 256)
            sent = time.monotonic()
            try:
                response = await client.post("/v2/models/slow/infer", json=affine_body(x),
                                             timeout=STRANDED_TIMEOUT_S)
            except httpx.ReadTimeout:
                stranded.append(sent)
                continue
            results.append((x, response))

    async with httpx.AsyncClient(base_url=cluster, timeout=WAIT_S) as client:
        loops = [asyncio.create_task(client_loop(client)) for _ in range(8)]
        try:
            await asyncio.sleep(2.0)
            killed = sorted(before)[0]
            ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
            killed_at = time.monotonic()
            at_kill = len(results)
            await asyncio.sleep(3.0)
        finally:
            stop.set()
            await asyncio.gather(*loops)
        deadline = time.monotonic() + WAIT_S
        while not _replaced(killed):
            assert time.monotonic() < deadline, "Serve did not replace the killed replica"
            await asyncio.sleep(0.5)
        after = [await client.post("/v2/models/slow/infer", json=affine_body(x))
                 for x in [torch.randn(1, 256) for _ in range(4)]]
    assert len(stranded) < len(loops) and all(sent <= killed_at for sent in stranded), (
        f"{len(stranded)} requests had no answer in {STRANDED_TIMEOUT_S} s, "
        f"{sum(sent > killed_at for sent in stranded)} of them sent after the kill")
    codes = [r.status_code for _, r in results]
    assert set(codes) <= {200, 503}, codes
    lost = [r for _, r in results if r.status_code == 503]
    assert all(r.headers.get("retry-after") == "1" for r in lost)
    assert all(correct(models, "slow", x, r) for x, r in results if r.status_code == 200)
    assert codes[at_kill:].count(200) > 0, "traffic stopped after the kill"
    assert [r.status_code for r in after] == [200] * 4
    print(f"{len(results)} requests, {len(lost)} lost with the replica (503), "
          f"{len(stranded)} stranded in Serve's router")


@pytest.mark.timeout(300)
def test_deleting_the_app_drains_requests_in_flight(cluster: str, models: dict[str, Any]) -> None:
    """serve.delete while 8 requests run; each gets its correct answer. The shared app is
    deployed again after, so the tests that run later in any order find it (shuffled by
    pytest-randomly, the 200-request test ran after this one and got 404s). A sync test: the
    app is deleted once."""
    try:
        asyncio.run(_drain(cluster, models))
    finally:
        _deploy_shared_app(models)


def _send_then_answer(cluster: str, body: dict[str, Any], sent: threading.Event) -> httpx.Response:
    """POST `body` on a connection of its own; `sent` is set once the whole request was
    written to the socket, before the answer is read."""
    url = urllib.parse.urlsplit(cluster)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=WAIT_S)
    try:
        payload = json.dumps(body).encode()
        connection.request("POST", "/v2/models/slow/infer", payload,
                           {"Content-Type": "application/json"})
        sent.set()
        answer = connection.getresponse()
        return httpx.Response(answer.status, content=answer.read())
    finally:
        connection.close()


async def _drain(cluster: str, models: dict[str, Any]) -> None:
    xs = [torch.randn(1, 256) for _ in range(8)]
    sent = [threading.Event() for _ in xs]
    calls = [asyncio.create_task(asyncio.to_thread(_send_then_answer, cluster, affine_body(x), s))
             for x, s in zip(xs, sent, strict=True)]
    # delete only once every request is on the proxy's socket: one still being sent when the
    # app goes is rightly a 404, and no test of draining (a fixed 50 ms sleep missed that)
    with anyio.fail_after(WAIT_S):
        while not all(s.is_set() for s in sent):  # noqa: ASYNC110 (set by threads)
            await asyncio.sleep(0.001)
    assert not all(c.done() for c in calls), "nothing was in flight to drain"
    await asyncio.to_thread(serve.delete, APP)
    responses = await asyncio.gather(*calls)
    assert [r.status_code for r in responses] == [200] * 8
    assert all(correct(models, "slow", x, r) for x, r in zip(xs, responses, strict=True))
