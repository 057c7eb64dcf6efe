"""The server under hostile traffic (issue 39, items 6-9), on a real uvicorn server on 127.0.0.1.

Raw sockets for what an HTTP client would not send: bodies that never finish, malformed HTTP.
Every wait is bounded (WAIT_S); nothing asserts a wall time.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch

import asyncgraph
from asyncgraph.serve import InferenceServer, create_app, running_server
from tests.support.models import Affine
from tests.support.serving import WAIT_S, eventually, metric

pytestmark = pytest.mark.usefixtures("leak_check")


@pytest.fixture(scope="module")
def linear() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=64)
    return torch.export.export(Affine().eval(), (torch.randn(2, 4),),
                               dynamic_shapes=({0: batch},))


@asynccontextmanager
async def serving(
    ex: asyncgraph.Executor, keep_alive_s: int = int(WAIT_S) * 3, **options: Any
) -> AsyncIterator[tuple[InferenceServer, httpx.AsyncClient, tuple[str, int]]]:
    options.setdefault("calibrate", False)
    app = create_app({"lin": ex}, **options)
    async with (
        running_server(app, timeout_keep_alive=keep_alive_s) as url,
        httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client,
    ):
        host, port = url.removeprefix("http://").split(":")
        yield app.state.asyncgraph, client, (host, int(port))


def infer_body(x: torch.Tensor, **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.reshape(-1).tolist()}], **extra}


def head(length: int, path: str = "/v2/models/lin/infer") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, within WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        status = int((await reader.readline()).split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", 0)))
    return status, headers, body


@pytest.mark.timeout(60)
async def test_idle_bodies_declaring_the_memory_cap_do_not_lock_the_model_out(
    linear: Any,
) -> None:
    """The issue's attack at a small scale: --max-queue-bytes is 4 x --max-request-bytes,
    and 4 connections declare a maximal body each and send 10 bytes. The gate charged the
    declared lengths, so every other request got 503 for as long as they stayed open; it now
    charges what arrived (40 bytes), and the next request is served."""
    limit = 64 << 10
    async with asyncgraph.Executor(linear) as ex, serving(ex, max_request_bytes=limit) as (
        server, client, (host, port)
    ):
        admission = server.served("lin").admission
        idle = []
        try:
            for k in range(4):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(head(limit) + b'{"inputs":')
                idle.append((reader, writer))
                await eventually(
                    lambda k=k: admission.statistics().queued_bytes == 10 * (k + 1),
                    f"idle request {k} admitted, charged the 10 bytes it sent",
                )
            assert admission.queued == 4
            r = await client.post("/v2/models/lin/infer", json=infer_body(torch.ones(1, 4)))
            assert r.status_code == 200, r.text
        finally:
            for _reader, writer in idle:
                writer.close()
                await writer.wait_closed()
        await eventually(lambda: admission.queued == 0, "the idle requests left the gate")
        assert admission.statistics().queued_bytes == 0
        assert admission.refused["max_queue_bytes"] == 0


@pytest.mark.timeout(60)
async def test_a_body_that_does_not_arrive_in_time_gets_408_and_its_connection_closes(
    linear: Any,
) -> None:
    async with asyncgraph.Executor(linear) as ex, serving(ex, body_timeout_s=0.2) as (
        server, client, (host, port)
    ):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head(1000) + b'{"inputs":')
            status, headers, body = await read_response(reader)
            assert status == 408, body
            assert headers["connection"] == "close"
            assert json.loads(body) == {"error": "request body: 10 of 1000 bytes arrived in "
                                                 "0.2 s, the limit for a body (--body-timeout-s)"}
            async with asyncio.timeout(WAIT_S):
                assert await reader.read() == b""  # the server closed it
        finally:
            writer.close()
            await writer.wait_closed()
        text = (await client.get("/metrics")).text
        assert server.served("lin").admission.queued == 0
        assert ex.statistics().started == 0
    assert metric(text, "nv_inference_request_failure", model="lin", reason="OTHER") == 1
    assert metric(text, "asyncgraph_requests_total", model="lin", code="408") == 1


async def test_a_response_over_max_response_bytes_is_refused_naming_the_limit(
    linear: Any,
) -> None:
    """64 rows x 3 FP32 outputs as JSON are estimated at 25 bytes a value (4,800 + the
    entry): over a 2,000-byte limit; as binary data (768 bytes) they fit, as does one row."""
    async with asyncgraph.Executor(linear) as ex, serving(ex, max_response_bytes=2000) as (
        _server, client, _address
    ):
        x = torch.randn(64, 4)
        r = await client.post("/v2/models/lin/infer", json=infer_body(x))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "over the limit of 2000 bytes (--max-response-bytes)" in error, error
        binary = infer_body(x, outputs=[{"name": "output_0",
                                         "parameters": {"binary_data": True}}])
        assert (await client.post("/v2/models/lin/infer", json=binary)).status_code == 200
        one = await client.post("/v2/models/lin/infer", json=infer_body(x[:1]))
        assert one.status_code == 200, one.text
        twice = infer_body(x[:1], outputs=[{"name": "output_0"}] * 2)
        r = await client.post("/v2/models/lin/infer", json=twice)
        assert r.status_code == 400
        assert "outputs[1].name: output 'output_0' requested twice" in r.json()["error"]


async def test_json_beyond_max_json_bytes_is_413_plain_or_compressed(linear: Any) -> None:
    """`[],` repeated outside the data arrays: 64 MB of it held the GIL for 12 s in
    json.loads (and a 61 KB gzip body inflating to it, 2.2 GB); it is refused by its size."""
    x = torch.randn(2, 4)
    junk = json.dumps({**infer_body(x), "junk": [[]] * 2000}).encode()
    async with asyncgraph.Executor(linear) as ex, serving(ex, max_json_bytes=4096) as (
        _server, client, _address
    ):
        assert (await client.post("/v2/models/lin/infer", json=infer_body(x))).status_code == 200
        for body, headers in ((junk, {}), (gzip.compress(junk), {"content-encoding": "gzip"})):
            r = await client.post("/v2/models/lin/infer", content=body, headers=headers)
            assert r.status_code == 413, r.text
            assert "over the limit of 4096 bytes (--max-json-bytes)" in r.json()["error"]
        assert ex.statistics().started == 1


async def test_a_trailing_slash_is_a_json_404_not_a_redirect(linear: Any) -> None:
    async with asyncgraph.Executor(linear) as ex, serving(ex) as (_server, client, _address):
        r = await client.post("/v2/models/lin/infer/", json=infer_body(torch.ones(1, 4)))
        assert r.status_code == 404
        assert r.json() == {"error": "POST /v2/models/lin/infer/: Not Found"}
        assert (await client.get("/v2/health/live/")).status_code == 404


async def test_malformed_http_gets_uvicorns_plain_text_400_and_a_close(linear: Any) -> None:
    """What docs/serving.md says of HTTP that never reaches the app: h11 refuses it, uvicorn
    answers `400 Invalid HTTP request received.` in plain text and closes the connection."""
    async with asyncgraph.Executor(linear) as ex, serving(ex) as (_server, _client, address):
        for raw in (b"GARBAGE\r\n\r\n", b"POST /v2/models/lin/infer HTTP/1.1\r\nHost: t\r\n"
                    b"Content-Length: x\r\n\r\n"):
            reader, writer = await asyncio.open_connection(*address)
            try:
                writer.write(raw)
                async with asyncio.timeout(WAIT_S):
                    answer = await reader.read()  # all of it: the server closes the connection
                assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
                assert b"content-type: text/plain" in answer.lower(), answer
                assert b"Invalid HTTP request received." in answer, answer
            finally:
                writer.close()
                await writer.wait_closed()
        assert ex.statistics().started == 0


@pytest.mark.timeout(60)
async def test_a_request_sent_while_the_loop_is_held_past_the_keep_alive_timeout_is_answered(
    linear: Any,
) -> None:
    """Issue 39 saw a keep-alive request sent during a long stall lose its connection. A
    stall of the loop itself does not: the test holds the loop (server included) past a 1 s
    keep-alive right after sending its second request, and the loop reads the request
    before it runs the keep-alive timer that expired meanwhile (uvloop and asyncio alike)."""
    body = json.dumps(infer_body(torch.ones(1, 4))).encode()
    async with asyncgraph.Executor(linear) as ex, serving(ex, keep_alive_s=1) as (
        _server, _client, (host, port)
    ):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head(len(body)) + body)
            assert (await read_response(reader))[0] == 200
            writer.write(head(len(body)) + body)  # sent now, while the connection is open
            time.sleep(1.5)  # noqa: ASYNC251 - the stall: the loop is held past the keep-alive
            status, _, answer = await read_response(reader)
            assert status == 200, answer
        finally:
            writer.close()
            await writer.wait_closed()
        assert ex.statistics().completed == 2
